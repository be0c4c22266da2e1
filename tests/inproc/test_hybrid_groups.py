"""Hybrid-attention models (a full-attention and a sliding-window KV-cache group) in
vLLM's real scheduler, KVCacheManager and BlockPool, with KvHint installed.

What a user sees: a hinted session's resume gets the same prefix hit after cache
pressure as it got without pressure, although a hybrid hit needs every group to
hit (full attention: every block; sliding window: the window ending at the
prefix end); Release and Evict act on every group's copies; counts are logical
blocks. Both group orders are covered (vLLM numbers Gemma 2's groups by layer).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import layout_support
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pool_support import check_filing, evict, pin, release, retain, session, tokens
from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id
from vllm.v1.kv_cache_interface import KVCacheGroupSpec

from engine_integration import inproc
from engine_integration.kv_groups import residency_view
from kvhint.v1 import kvhint_pb2 as pb
from kvhint_client import KvHintClient
from kvhint_server.events import BlocksRemoved, BlocksStored
from kvhint_server.model import KvCacheGroupKind, Outcome, Tier

BLOCK = 16
WINDOW = 64  # a hit needs ceil(63 / 16) = 4 sliding-window blocks
PROMPT = 10 * BLOCK
POOL = 48  # a session caches 10 full-attention + 4 window blocks; a prefill needs 2 x 11


@contextlib.contextmanager
def hybrid(window_first: bool = False, num_blocks: int = POOL, retention_interval: int | None = 0) -> Iterator[Any]:
    """A KvHint scheduler over two groups; window_first puts the sliding-window group at id 0.

    retention_interval is vLLM's prefix_cache_retention_interval: 0 (the engine's
    default) caches sliding-window blocks only at the window tail of each prompt's
    end; None caches every one."""
    edit = (lambda cfg: cfg.kv_cache_groups.reverse()) if window_first else None
    with layout_support.scheduler(
        retention_interval, edit=edit, num_blocks=num_blocks, block_size=BLOCK, hybrid=True, sliding_window=WINDOW
    ) as s:
        yield s


def run(scheduler: Any, rid: str, prompt: list[int], sid: str | None = None) -> int:
    """Serve one request to completion; its prefix hit in tokens."""
    return layout_support.run(scheduler, rid, prompt, sid, block_size=BLOCK)


apply = layout_support.apply


def resume(seed: str) -> list[int]:
    return prompt_of(seed) + tokens(999, 20)


def prompt_of(seed: str) -> list[int]:
    return tokens(sum(map(ord, seed)) % 500, PROMPT)


def fill(scheduler: Any, tag: str, n: int = 4) -> None:
    for i in range(n):
        run(scheduler, f"fill-{tag}-{i}", tokens(600 + 10 * i + len(tag), PROMPT))


def copies_by_group(scheduler: Any, seed: str) -> dict[int, int]:
    """Cached copies of the prompt's logical blocks, per group id."""
    chain = {bytes(h) for h in inproc.make_request("probe", prompt_of(seed), block_size=BLOCK).block_hashes}
    out: dict[int, int] = {}
    for key, entry in scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block._cache.items():
        if bytes(get_block_hash(key)) in chain:
            out[get_group_id(key)] = out.get(get_group_id(key), 0) + (len(entry) if isinstance(entry, dict) else 1)
    return out


def unpressured_hit(window_first: bool) -> int:
    with hybrid(window_first) as s:
        run(s, "a", prompt_of("A"), "A")
        return run(s, "a2", resume("A"), "A")


ORDERS = pytest.mark.parametrize("window_first", [False, True], ids=["full-first", "window-first"])


@ORDERS
def test_capabilities_list_both_groups_and_which_define_residency(window_first: bool) -> None:
    with hybrid(window_first) as s, KvHintClient(s.kvhint_server.address) as client:
        groups = {g.kind: g for g in client.capabilities(timeout=5).kv_cache_groups}
    full, window = groups[pb.KvCacheGroup.KIND_FULL_ATTENTION], groups[pb.KvCacheGroup.KIND_SLIDING_WINDOW]
    assert (full.group_id, window.group_id) == ((1, 0) if window_first else (0, 1))
    assert full.defines_residency and not window.defines_residency
    assert window.sliding_window_tokens == WINDOW and full.block_size == window.block_size == BLOCK


@ORDERS
@pytest.mark.parametrize("action", ["pin", "retain"])
def test_hinted_session_keeps_its_prefix_hit_under_pressure_on_both_groups(window_first: bool, action: str) -> None:
    expected = unpressured_hit(window_first)
    assert expected >= PROMPT - 2 * BLOCK  # the window tail at the prompt end is cached

    with hybrid(window_first) as s:
        run(s, "control", prompt_of("C"), "C")
        run(s, "a", prompt_of("A"), "A")
        full, window = (1, 0) if window_first else (0, 1)
        assert copies_by_group(s, "A") == {full: 10, window: 4}
        hint = pin(session("A")) if action == "pin" else retain(session("A"), priority=5)
        (result,) = apply(s, hint)
        assert result.outcome is Outcome.ACCEPTED
        assert result.affected[Tier.DEVICE] == 10  # logical blocks, not copies
        fill(s, action)
        assert run(s, "c2", resume("C"), "C") == 0  # the same pressure evicted the unhinted session
        assert run(s, "a2", resume("A"), "A") == expected


@ORDERS
def test_evict_frees_every_groups_copies(window_first: bool) -> None:
    with hybrid(window_first) as s:
        run(s, "a", prompt_of("A"), "A")
        (result,) = apply(s, evict(session("A")))
        assert result.outcome is Outcome.ACCEPTED and result.affected[Tier.DEVICE] == 10
        assert copies_by_group(s, "A") == {}
        assert run(s, "a2", resume("A"), "A") == 0


@ORDERS
def test_release_makes_every_groups_copies_the_first_candidates(window_first: bool) -> None:
    expected = unpressured_hit(window_first)
    with hybrid(window_first, num_blocks=40) as s:
        run(s, "older", prompt_of("O"), "O")
        run(s, "a", prompt_of("A"), "A")
        (result,) = apply(s, release(session("A")))
        assert result.outcome is Outcome.ACCEPTED and result.affected[Tier.DEVICE] == 10
        fill(s, "release", n=1)  # room for one prefill: LRU would take `older` first
        assert copies_by_group(s, "A") == {}
        assert run(s, "o2", resume("O"), "O") == expected


def test_pinned_window_copies_are_protected_free_blocks() -> None:
    with hybrid() as s:
        run(s, "a", prompt_of("A"), "A")
        apply(s, pin(session("A")))
        pool = s.kv_cache_manager.block_pool
        protected = pool._kvh_protected.blocks()
        assert sorted(get_group_id(b.block_hash) for b in protected) == [0] * 10 + [1] * 4
        assert all(b.ref_cnt == 0 for b in protected)
        apply(s, release(session("A")))
        assert pool._kvh_protected.count == 0


@ORDERS
@pytest.mark.parametrize("action", ["retain", "pin"])
@pytest.mark.parametrize("past_the_queue", [1, 2, 5, 9])
def test_no_copy_stays_protected_after_its_blocks_hint_ended(window_first: bool, action: str, past_the_queue: int) -> None:
    """An allocation that needs more than the ordinary free queue takes protected copies one at
    a time, so it can stop between a block's full-attention copy and its sliding-window copy.
    The block's grant ends there (its residency copy was evicted, or its pin broken); the copy
    left in the other group must not stay protected with no grant behind it (it outranked every
    ordinary block, Release could not reach it, and it was broken as a pin a second time)."""
    with hybrid(window_first) as s:
        pool, adapter, core = s.kv_cache_manager.block_pool, s.kvhint_adapter, s.kvhint_core
        broken: list[bytes] = []
        on_pin_broken = core.on_pin_broken
        core.on_pin_broken = lambda hashes, n, sessions=None: (broken.extend(hashes), on_pin_broken(hashes, n, sessions))
        run(s, "a", prompt_of("A"), "A")
        hint = retain(session("A"), priority=5) if action == "retain" else pin(session("A"))
        assert apply(s, hint)[0].outcome is Outcome.ACCEPTED
        for _ in range(2):  # pressure, then more pressure
            extra = min(past_the_queue, pool._kvh_protected.count)  # what the pool can give
            taken = pool.get_new_blocks(pool.free_block_queue.num_free_blocks + extra)
            pool.free_blocks(taken)
            core.settle()
            grants = core.ledger.grants
            orphans = [b.block_id for b in pool._kvh_protected.blocks() if adapter.external(get_block_hash(b.block_hash)) not in grants]
            assert not orphans, f"protected copies with no grant: {orphans}"
        assert len(broken) == len(set(broken)), "a pin broken twice"
        apply(s, release(session("A")))
        assert pool._kvh_protected.count == 0 and not core.ledger.grants
        run(s, "b", prompt_of("B"))  # the next step boundary turns the retention order off
        assert not pool.kvh_retaining


def _layout(name: str) -> Any:
    """A KV-cache config edit: full-first (vLLM's order for Llama-style layer lists), window-first
    (Gemma 2's), or two window groups ahead of the full-attention one (as Gemma 3's five)."""

    def edit(cfg: Any) -> None:
        full, window = cfg.kv_cache_groups
        if name == "dense":
            cfg.kv_cache_groups[:] = [full]
        elif name == "window-first":
            cfg.kv_cache_groups[:] = [window, full]
        elif name == "two-windows":
            cfg.kv_cache_groups[:] = [window, KVCacheGroupSpec(["window.1"], window.kv_cache_spec), full]

    return edit


@pytest.mark.parametrize("layout", ["full-first", "window-first", "two-windows"])
@pytest.mark.parametrize("retention_interval", [0, None], ids=["window-tails", "every-window-block"])
@pytest.mark.parametrize("action", ["retain", "pin"])
def test_pressure_on_a_session_hinted_while_it_ran_does_not_cut_its_chain(
    layout: str, retention_interval: int | None, action: str
) -> None:
    """A session hinted while its request runs (an agent's next turn under the last turn's
    grant): vLLM frees the window copies that leave the window as the request decodes, and
    were filed as protected first, and vLLM frees the rest group after group. One copy of
    pressure past the free queue must take from the chain's tail (the documented order), so the
    resume loses at most its last block; it took the early window copies, or the full-attention
    copy of a block in the middle, and with vLLM's default of window tails at prompt ends
    (retention interval 0) the resume lost its whole hit (144 tokens to 0)."""

    def resume_hit(pressure: int) -> int:
        with layout_support.scheduler(
            retention_interval, edit=_layout(layout), num_blocks=48, block_size=BLOCK, hybrid=True, sliding_window=WINDOW
        ) as s:
            pool = s.kv_cache_manager.block_pool
            s.add_request(inproc.make_request("a", prompt_of("A"), session_id="A", max_tokens=4, block_size=BLOCK))
            inproc.step(s)  # prefill: A's blocks are cached and in use
            (result,) = apply(s, pin(session("A")) if action == "pin" else retain(session("A"), priority=5))
            assert result.outcome is Outcome.ACCEPTED
            while inproc.busy(s):
                inproc.step(s)
            if pressure:
                taken = pool.get_new_blocks(pool.free_block_queue.num_free_blocks + pressure)
                pool.free_blocks(taken)
            return run(s, "a2", resume("A"), "A")

    unpressured = resume_hit(0)
    assert unpressured > 0 and resume_hit(1) >= unpressured - BLOCK  # at most the chain's last block


@pytest.mark.parametrize("layout", ["dense", "full-first", "window-first"])
def test_a_retain_sent_again_after_the_next_turn_orders_the_whole_chain_tail_first(layout: str) -> None:
    """Turn 1, Retain, turn 2 (extending turn 1's chain), the same Retain again: one copy of
    pressure must take the chain's last block, not turn 1's last block in the middle of it.
    Turn 1's blocks were filed when turn 2 freed them (its grant was still in effect), turn 2's
    own blocks by the second Retain, and a Retain that changed no block's class or priority
    left the order as it was: the next turn's hit fell from 320 to 144 tokens (dense too)."""

    def next_turn_hit(pressure: int) -> int:
        with layout_support.scheduler(
            0, edit=_layout(layout), num_blocks=64, block_size=BLOCK, hybrid=True, sliding_window=WINDOW
        ) as s:
            pool = s.kv_cache_manager.block_pool
            first = prompt_of("A")
            second = first + tokens(321, 10 * BLOCK)
            for rid, prompt in (("t1", first), ("t2", second)):
                run(s, rid, prompt, "A")
                assert apply(s, retain(session("A"), priority=5))[0].outcome is Outcome.ACCEPTED
            if pressure:
                taken = pool.get_new_blocks(pool.free_block_queue.num_free_blocks + pressure)
                pool.free_blocks(taken)
            return run(s, "t3", second + tokens(999, 20), "A")

    unpressured = next_turn_hit(0)
    assert unpressured >= 18 * BLOCK and next_turn_hit(1) >= unpressured - BLOCK


turns = st.lists(
    st.tuples(st.sampled_from(["A", "B"]), st.integers(1, 4), st.sampled_from(["none", "during", "after"])),
    min_size=1,
    max_size=5,
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=turns, layout=st.sampled_from(["dense", "full-first", "window-first", "two-windows"]),
       retention_interval=st.sampled_from([0, None]), action=st.sampled_from(["retain", "pin"]))
def test_one_copy_of_pressure_costs_a_hinted_chain_at_most_its_last_block(
    workload: list[tuple[str, int, str]], layout: str, retention_interval: int | None, action: str
) -> None:
    """Multi-turn sessions hinted before, during or after their turns, and hinted again after
    their last one (so the grant covers the whole chain): one copy of pressure past the free
    queue costs each hinted session's resume at most its chain's last block, whatever order
    vLLM freed the copies in (the retention order takes a chain's deepest block first)."""
    if layout == "dense":
        retention_interval = 0

    def hits(pressure: int) -> dict[str, int]:
        with layout_support.scheduler(
            retention_interval, edit=_layout(layout), num_blocks=96, block_size=BLOCK, hybrid=True, sliding_window=WINDOW
        ) as s:
            pool = s.kv_cache_manager.block_pool
            prompts: dict[str, list[int]] = {}
            hinted: set[str] = set()

            def hint(sid: str) -> None:
                apply(s, pin(session(sid)) if action == "pin" else retain(session(sid), priority=5))
                hinted.add(sid)

            for i, (sid, blocks, mode) in enumerate(workload):
                prompts[sid] = prompts.get(sid, tokens(ord(sid), 2 * BLOCK)) + tokens(100 + i, blocks * BLOCK)
                s.add_request(inproc.make_request(f"r{i}", prompts[sid], session_id=sid, max_tokens=3, block_size=BLOCK))
                inproc.step(s)
                if mode == "during":
                    hint(sid)
                while inproc.busy(s):
                    inproc.step(s)
                if mode == "after":
                    hint(sid)
            for sid in sorted(hinted):
                hint(sid)
            if pressure and pool._kvh_protected.count:
                taken = pool.get_new_blocks(pool.free_block_queue.num_free_blocks + pressure)
                pool.free_blocks(taken)
            return {sid: run(s, f"resume-{sid}", prompts[sid] + tokens(999, 20), sid) for sid in sorted(hinted)}

    before, after = hits(0), hits(1)
    for sid, hit in before.items():
        assert after[sid] >= hit - BLOCK, f"session {sid}: {hit} -> {after[sid]} tokens"


@pytest.mark.parametrize("layout", ["full-first", "window-first", "two-windows"])
@pytest.mark.parametrize("past_the_queue", [1, 2])
def test_a_broken_pin_spares_no_ordinary_block(layout: str, past_the_queue: int) -> None:
    """Pins break only for what the free queue cannot give: an allocation past the queue takes
    every ordinary free block before a pinned copy it did not have to break for. The other
    copies of a block whose pin broke were made ordinary before the allocation, at the queue's
    head, so they went ahead of ordinary blocks, one of which stayed cached."""
    with layout_support.scheduler(0, edit=_layout(layout), num_blocks=64, block_size=BLOCK, hybrid=True, sliding_window=WINDOW) as s:
        pool, adapter = s.kv_cache_manager.block_pool, s.kvhint_adapter
        run(s, "a", prompt_of("A"), "A")
        assert apply(s, pin(session("A")))[0].outcome is Outcome.ACCEPTED
        ordinary = tokens(50, 6 * BLOCK)
        run(s, "o", ordinary)  # ordinary cached blocks in the free queue
        chain = [adapter.external(h) for h in inproc.make_request("p", ordinary, block_size=BLOCK).block_hashes]
        assert any(adapter._copies(h) for h in chain)
        taken = pool.get_new_blocks(pool.free_block_queue.num_free_blocks + past_the_queue)
        s.kvhint_core.settle()
        assert not [i for i, h in enumerate(chain) if adapter._copies(h)], "ordinary blocks stayed cached"
        pool.free_blocks(taken)


# ---------------------------------------------------------------- residency, by property

prompts = st.lists(
    st.tuples(st.integers(0, 3), st.integers(1, 14), st.sampled_from(["s0", "s1", None])), min_size=1, max_size=8
)


def _wire(h: Any) -> bytes:
    return h.to_bytes(8, "big") if isinstance(h, int) else bytes(h)[-8:]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=prompts, window_first=st.booleans())
def test_reported_residency_is_full_attention_residency(workload: list[tuple[int, int, str | None]], window_first: bool) -> None:
    """After any workload (shared prefixes, eviction): the blocks KvHint reports
    resident are exactly those whose full-attention copy is cached; every window
    copy of a resident block resolves through its logical block; and KvHint's stored/removed events
    are vLLM's own KV events of the full-attention group, hash for hash, in order,
    with removals of a copy that leaves another copy cached left out (KvHint
    reports blocks, not copies: kv_groups.residency_view)."""
    with hybrid(window_first, num_blocks=40) as s:
        pool = s.kv_cache_manager.block_pool
        pool.enable_kv_cache_events = True  # vLLM's own event queue, as --kv-events-config turns on
        published: list[Any] = []  # what the scheduler takes from the pool each step (and would publish)
        take = pool.take_events
        pool.take_events = lambda: published.extend(take()) or published[len(published):]
        for i, (prefix, blocks, sid) in enumerate(workload):
            run(s, f"r{i}", tokens(prefix, 4 * BLOCK) + tokens(50 + i, blocks * BLOCK), sid)
        adapter = s.kvhint_adapter
        full = next(g.group_id for g in adapter.groups.infos if g.kind is KvCacheGroupKind.FULL_ATTENTION)
        by_group: dict[int, set[bytes]] = {}
        for key in pool.cached_block_hash_to_block._cache:
            by_group.setdefault(get_group_id(key), set()).add(adapter.external(get_block_hash(key)))
        assert adapter._resident == by_group.get(full, set())
        assert {b.block_hash for b in adapter.device_blocks()} == by_group.get(full, set())
        # Every window copy of a resident block resolves through its logical block (hints
        # protect and evict it with the block); the digest map holds the resident blocks and no
        # more (a window copy whose full copy is gone is no use to a hit, and is not tracked).
        for ext in by_group.get(1 - full, set()) & by_group.get(full, set()):
            copies = adapter._copies(ext)
            assert any(get_group_id(b.block_hash) == 1 - full for b in copies), "a window copy hints could not reach"
        if adapter._int_hashes:
            assert set(adapter._digest) == by_group.get(full, set())

        theirs = [(kind, _wire(h)) for kind, h, _ in residency_view(published + take(), {full})]
        ours = [
            ("stored" if isinstance(e.payload, BlocksStored) else "removed", h)
            for e in s.kvhint_core.bus.read_after(0, 1_000_000)
            if isinstance(e.payload, BlocksRemoved) or (isinstance(e.payload, BlocksStored) and not e.payload.prefix_hit)
            for h in e.payload.block_hashes
        ]
        assert theirs and ours == theirs


# ---------------------------------------------------------------- retention filing, by property

traffic = st.lists(
    st.one_of(
        # serve a session's turn: a shared prefix (of 4), the session's own blocks
        st.tuples(st.just("run"), st.integers(0, 3), st.integers(1, 6), st.sampled_from(["A", "B", "C"])),
        st.tuples(st.just("hint"), st.sampled_from(["retain", "pin", "release", "evict"]), st.sampled_from(["A", "B", "C"]),
                  st.integers(-1, 3)),
        # pressure: an allocation `extra` blocks past the ordinary free queue (protected copies
        # are taken one at a time, so it can stop between a block's two copies), then freed
        st.tuples(st.just("pressure"), st.integers(0, 9)),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(opening=st.sampled_from(["retain", "pin"]), ops=traffic, window_first=st.booleans(), fast_paths=st.booleans())
def test_every_free_copy_is_filed_by_its_blocks_retention_class(opening: str, ops: list[tuple[Any, ...]], window_first: bool,
                                                                fast_paths: bool) -> None:
    """Random turns, hints and pressure on both groups; after each, every free cached copy, of
    either group, is filed by its logical block's retention class (what QueryResidency
    reports): ordinary copies in vLLM's free queue, retained and pinned ones protected, with
    the class's priority; no protected copy outlives its block's grants, and no grant its
    block; and every free block is counted free once (pool_support.check_filing). An eviction
    ends grants and unprotects the other copies of its blocks with a grant only (the blocks
    without one have no copy filed as protected). With or without the pool paths that repeat
    vLLM 0.32's statements (engine_integration/vllm_compat.py)."""
    with hybrid(window_first, num_blocks=POOL) as s:
        pool, adapter, core = s.kv_cache_manager.block_pool, s.kvhint_adapter, s.kvhint_core
        pool._kvh_fast_alloc = pool._kvh_tail_walk = fast_paths
        # Every example opens with a hinted session, so that its pressure meets protected copies.
        ops = [("run", 0, 6, "A"), ("hint", opening, "A", 1), *ops]
        for n, op in enumerate(ops):
            if op[0] == "run":
                _, prefix, own, sid = op
                run(s, f"r{n}", tokens(prefix, 4 * BLOCK) + tokens(100 + 10 * n, own * BLOCK), sid)
            elif op[0] == "hint":
                _, action, sid, priority = op
                other = {"pin": pin, "release": release, "evict": evict}
                apply(s, retain(session(sid), priority=priority) if action == "retain" else other[action](session(sid)))
            else:
                extra = min(op[1], pool._kvh_protected.count)
                taken = pool.get_new_blocks(pool.free_block_queue.num_free_blocks + extra)
                pool.free_blocks(taken)
            core.settle()
            check_filing(pool, core, adapter, f"op {n} {op}: ")
