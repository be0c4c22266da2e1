"""A Retain or Pin clipped by a block budget (max_blocks, the engine's pin budget) on a hybrid
model, in vLLM's real scheduler, KVCacheManager and BlockPool with KvHint installed.

A clip keeps the start of the selected chain. On a dense model every prefix of it is a prefix
hit. On a hybrid model a hit must end where every sliding-window group holds the window's
blocks, and with vLLM's default (prefix_cache_retention_interval=0) those are cached only at
the end of each prompt. So the blocks a clip keeps after the last such end can never be part of
a hit: the hint drops them, says so in a clip (WINDOW_TAIL_MISSING), and leaves them to the
pool and the budget. What a user sees: the granted count is what a resume can hit, and the
budget those blocks would have held goes to the next hint.
"""

from __future__ import annotations

from typing import Any

import layout_support
import pytest
from pool_support import pin, retain, session, tokens
from test_hybrid_groups import BLOCK, WINDOW, _layout

from kvhint.v1 import kvhint_pb2 as pb
from kvhint_server.model import Outcome, Reason, Tier

LAYOUTS = pytest.mark.parametrize("layout", ["dense", "full-first", "window-first", "two-windows"])
ACTIONS = pytest.mark.parametrize("action", ["retain", "pin"])


def _scheduler(layout: str, num_blocks: int = 96) -> Any:
    return layout_support.scheduler(
        0, edit=_layout(layout), num_blocks=num_blocks, block_size=BLOCK, hybrid=True, sliding_window=WINDOW
    )


def run(s: Any, rid: str, prompt: list[int], sid: str | None = None) -> int:
    return layout_support.run(s, rid, prompt, sid, block_size=BLOCK)


def hint(action: str, sid: str, max_blocks: int = 0) -> pb.Hint:
    h = pin(session(sid)) if action == "pin" else retain(session(sid), priority=5)
    h.max_blocks = max_blocks
    return h


def pressure(s: Any) -> None:
    """Take every free block once and give it back: whatever no hint protects is evicted."""
    pool = s.kv_cache_manager.block_pool
    pool.free_blocks(pool.get_new_blocks(pool.free_block_queue.num_free_blocks))


def two_turns(s: Any, sid: str, first_blocks: int, second_blocks: int) -> list[int]:
    """Turn 1 of `first_blocks` blocks, turn 2 extending it to `second_blocks`; turn 2's prompt."""
    first = tokens(sum(map(ord, sid)) % 500, first_blocks * BLOCK)
    second = first + tokens(321, (second_blocks - first_blocks) * BLOCK)
    run(s, f"{sid}-t1", first, sid)
    run(s, f"{sid}-t2", second, sid)
    return second


@LAYOUTS
@ACTIONS
def test_a_clipped_hint_keeps_the_longest_prefix_a_resume_can_hit(layout: str, action: str) -> None:
    """Turns of 10 and 20 blocks, the hint clipped to 15 blocks: on a dense model the 15 blocks
    are the hit; on a hybrid one the hit ends at turn 1's end (block 10), the only prompt end
    inside the 15, and the hint grants those 10."""
    with _scheduler(layout) as s:
        second = two_turns(s, "A", 10, 20)
        (result,) = layout_support.apply(s, hint(action, "A", max_blocks=15))
        pressure(s)
        hit = run(s, "A-t3", second + tokens(999, 20), "A")
    assert result.outcome is Outcome.CLIPPED and result.reason is Reason.MAX_BLOCKS
    if layout == "dense":
        assert [(c.reason, c.granted_blocks) for c in result.clips] == [(Reason.MAX_BLOCKS, 15)]
        assert result.affected == {Tier.DEVICE: 15} and hit == 15 * BLOCK
        return
    assert [(c.reason, c.requested_blocks, c.granted_blocks) for c in result.clips] == [
        (Reason.MAX_BLOCKS, 20, 15), (Reason.WINDOW_TAIL_MISSING, 15, 10)
    ]
    assert result.affected == {Tier.DEVICE: 10}
    assert hit == 10 * BLOCK  # what the 15 blocks gave before: the dropped 5 held nothing a resume reads


@LAYOUTS
@ACTIONS
def test_a_clip_with_no_prompt_end_inside_it_grants_nothing_on_a_hybrid_model(layout: str, action: str) -> None:
    """One 20-block prompt, the hint clipped to 15: on a hybrid model no resume can hit any of
    the 15 (their window copies were never cached), so the hint grants none of them."""
    with _scheduler(layout) as s:
        prompt = tokens(77, 20 * BLOCK)
        run(s, "A-t1", prompt, "A")
        (result,) = layout_support.apply(s, hint(action, "A", max_blocks=15))
        granted = sum(len(g) for g in s.kvhint_core.ledger.grants.values())
        pressure(s)
        hit = run(s, "A-t2", prompt + tokens(999, 20), "A")
    assert result.outcome is Outcome.CLIPPED
    if layout == "dense":
        assert result.affected == {Tier.DEVICE: 15} and hit == 15 * BLOCK
        return
    assert [(c.reason, c.granted_blocks) for c in result.clips] == [
        (Reason.MAX_BLOCKS, 15), (Reason.WINDOW_TAIL_MISSING, 0)
    ]
    assert result.affected == {} and granted == 0 and hit == 0


@pytest.mark.parametrize("layout", ["full-first", "window-first", "two-windows"])
def test_the_pin_budget_a_clip_does_not_use_goes_to_the_next_pin(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pin budget of 12 blocks. Session A (turns of 8 and 16 blocks) is pinned first and
    clipped by the budget; of the 12 blocks it could take, a resume can hit the first 8 (turn
    1's end). Session B (4 blocks) is pinned next: it gets the 4 blocks A's clip did not use
    and keeps its hit under pressure, as A keeps its 8 blocks. Before, A's clip held all 12 and
    B's Pin was clipped to nothing."""
    monkeypatch.setenv("KVHINT_PIN_BUDGET_FRACTION", "0.2")  # int(0.2 * 63) = 12 blocks
    with _scheduler(layout, num_blocks=64) as s:
        assert s.kvhint_core.ledger.pin_budget_blocks == 12
        a = two_turns(s, "A", 8, 16)
        b = tokens(55, 4 * BLOCK)
        run(s, "B-t1", b, "B")
        ra, rb = layout_support.apply(s, hint("pin", "A"), hint("pin", "B"))
        pressure(s)
        hit_a = run(s, "A-t3", a + tokens(999, 20), "A")
        hit_b = run(s, "B-t2", b + tokens(998, 20), "B")
    assert [(c.reason, c.granted_blocks) for c in ra.clips] == [(Reason.PIN_BUDGET, 12), (Reason.WINDOW_TAIL_MISSING, 8)]
    assert rb.outcome is Outcome.ACCEPTED and rb.affected == {Tier.DEVICE: 4}
    # B's resume hits what it would with no pressure: 3 blocks, the blocks of its 63-token
    # prompt that vLLM lets a hit cover (the last prompt token is always computed).
    assert hit_a == 8 * BLOCK and hit_b == 3 * BLOCK
