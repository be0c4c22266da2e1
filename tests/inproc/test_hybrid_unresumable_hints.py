"""A Retain or Pin of blocks no resume can hit, on a hybrid model (vLLM's real scheduler, pool
and KV-cache groups, KvHint installed; the layout of test_hybrid_groups.py).

Found by following the README as a new user: after the session's sliding-window tails were gone
(pressure, or an Evict of the chain's end), a Pin of the session came back ACCEPTED with every
full-attention block it still held, and the resume hit nothing. A hybrid hit must end where every
sliding-window group holds the window's blocks, and the engine held none: the grant protected
nothing a resume reads while it took pin budget. Now such a hint grants nothing and says why
(CLIPPED to 0 blocks, REASON_WINDOW_TAIL_MISSING); a hint with a hit end to keep is unchanged."""

from __future__ import annotations

import pytest
from pool_support import evict, pin, retain, session
from test_hybrid_groups import BLOCK, ORDERS, apply, copies_by_group, hybrid, prompt_of, resume, run

from kvhint.v1 import kvhint_pb2 as pb
from kvhint_server.model import Outcome, Reason, Tier


def range_of(session_id: str, start: int, end: int | None = None) -> pb.Selector:
    r = pb.BlockRange(start=start) if end is None else pb.BlockRange(start=start, end=end)
    return pb.Selector(session=pb.SessionSelector(session_id=session_id), range=r)


@ORDERS
@pytest.mark.parametrize("action", ["pin", "retain"])
def test_a_hint_on_a_chain_whose_window_tails_are_gone_grants_nothing(window_first: bool, action: str) -> None:
    with hybrid(window_first) as s:
        run(s, "a", prompt_of("A"), "A")
        full, window = (1, 0) if window_first else (0, 1)
        assert copies_by_group(s, "A") == {full: 10, window: 4}
        # The chain's end goes, window tails with it: 5 full-attention blocks stay, and no window copy.
        (evicted,) = apply(s, evict(range_of("A", 5)))
        assert evicted.outcome is Outcome.ACCEPTED and evicted.affected[Tier.DEVICE] == 5
        assert copies_by_group(s, "A") == {full: 5}
        hint = pin(session("A")) if action == "pin" else retain(session("A"), priority=5)
        (result,) = apply(s, hint)
        assert result.outcome is Outcome.CLIPPED and result.reason is Reason.WINDOW_TAIL_MISSING, result
        assert [(c.reason, c.requested_blocks, c.granted_blocks) for c in result.clips] == [(Reason.WINDOW_TAIL_MISSING, 5, 0)]
        assert not result.affected
        assert not s.kvhint_core.ledger.grants  # nothing granted, no pin budget taken
        assert run(s, "a2", resume("A"), "A") == 0  # what the resume would have hit, granted or not


@ORDERS
def test_a_hint_with_a_hit_end_still_keeps_every_selected_block(window_first: bool) -> None:
    """The common case: the session just ran, its window tail at the prompt end is cached, and the
    Pin is ACCEPTED for all of its blocks as before (the block after the last hit end included)."""
    with hybrid(window_first) as s:
        run(s, "a", prompt_of("A"), "A")
        (result,) = apply(s, pin(session("A")))
        assert result.outcome is Outcome.ACCEPTED and result.affected[Tier.DEVICE] == 10
        assert run(s, "a2", resume("A"), "A") >= 9 * BLOCK


@ORDERS
def test_a_range_inside_a_chain_that_goes_on_keeps_its_blocks(window_first: bool) -> None:
    """Blocks 1 and 2 hold no window tail, but the session's hit end at its prompt end reads their
    full-attention copies: a Pin of that range protects part of the resume's hit, and is ACCEPTED
    for both blocks (the conformance case selectors/range-narrows-positions on the hybrid model)."""
    with hybrid(window_first) as s:
        run(s, "a", prompt_of("A"), "A")
        (result,) = apply(s, pin(range_of("A", 1, 3)))
        assert result.outcome is Outcome.ACCEPTED and result.affected[Tier.DEVICE] == 2, result
