"""vLLM's prefix-cache reset (`/reset_prefix_cache`, RLHF weight updates, EngineCore's pause and
sleep) on a pool with protected free blocks.

Retained and pinned free blocks sit outside vLLM's free queue (engine_integration/protected.py).
A reset drops every block's hash, so afterwards every free block is an ordinary, hashless block
in the queue, and KvHint's grants and index are gone. A reset vLLM refuses (a block still in
use) changes nothing: the protected blocks keep their classes and their order.

KvHint does not repeat vLLM's condition for a reset: it puts the protected blocks back in the
queue, lets vLLM decide, and files them again if vLLM refuses. So a vLLM that checks another
condition (its free queue alone, or nothing) leaves no hashless block stranded outside the queue.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pool_support import (
    BLOCK_SIZE, SESSIONS, Cache, admit, check_filing, decode, free, pin, release, retain, session, tick, tokens, traffic_step,
)
from vllm.v1.core.block_pool import BlockPool

from kvhint_server.model import Outcome, RetentionClass


def _state(cache: Cache) -> tuple[list[int], list[tuple[int, Any]], list[int]]:
    """What the next allocations would take: the free queue, the protected blocks with their
    filings (in their buckets' order), and the order victims would be taken in."""
    protected = cache.pool._kvh_protected
    filed = [(b.block_id, protected.filed_as(b)) for b in protected.blocks()]
    return cache.free_queue(), filed, _victim_order(cache)


def _victim_order(cache: Cache) -> list[int]:
    """The protected blocks in the order memory pressure would take them (without taking them)."""
    protected = cache.pool._kvh_protected
    filings = [(b, protected.filed_as(b)) for b in protected.blocks()]
    retained, pinned = protected.take_victims(protected.count)
    order = [b.block_id for b in retained + pinned]
    for block, (cls, priority, reuse_at) in filings:  # put them back as they were
        protected.add(block, cls, priority, reuse_at)
    return order


def _assert_cleared(cache: Cache) -> None:
    pool = cache.pool
    assert pool._kvh_protected.count == 0 and not cache.filed(), "a block stayed protected after the reset"
    assert cache.cached() == {}, "a hash survived the reset"
    free = [b.block_id for b in pool.blocks if b.ref_cnt == 0 and not b.is_null]
    assert sorted(cache.free_queue()) == sorted(free), "a free block is missing from vLLM's queue"
    assert pool.get_num_free_blocks() == len(free)
    assert not cache.core.ledger.grants and not pool.kvh_retaining
    check_filing(pool, cache.core, cache.adapter)


def _retained_and_pinned(cache: Cache) -> None:
    cache.run("a1", tokens(0, 3 * BLOCK_SIZE), "a")
    cache.run("b1", tokens(1, 2 * BLOCK_SIZE), "b")
    assert [r.outcome for r in cache.apply(retain(session("a"), 60.0, 2), pin(session("b"), 60.0))] == [Outcome.ACCEPTED] * 2
    assert {cls for cls, _, _ in cache.filed().values()} == {RetentionClass.RETAINED, RetentionClass.PINNED}


def test_a_reset_leaves_every_free_block_ordinary_hashless_and_queued() -> None:
    cache = Cache(16)
    _retained_and_pinned(cache)
    assert cache.pool.reset_prefix_cache() is True
    _assert_cleared(cache)
    # The whole pool serves an allocation again, and a hint finds nothing to protect.
    assert len(cache.allocate(15)) == 15
    [result] = cache.apply(retain(session("a")))
    assert result.outcome is not Outcome.ACCEPTED or not result.affected


def test_a_refused_reset_keeps_the_protected_blocks_filed_in_their_order() -> None:
    cache = Cache(16)
    _retained_and_pinned(cache)
    running = cache.admit("c1", tokens(2, 2 * BLOCK_SIZE), "c")
    assert running is not None
    before = _state(cache)
    assert cache.pool.reset_prefix_cache() is False  # c1 holds blocks
    assert _state(cache) == before
    check_filing(cache.pool, cache.core, cache.adapter)
    cache.free(running)
    assert cache.pool.reset_prefix_cache() is True
    _assert_cleared(cache)


def _reset_checking_the_queue_only(self: BlockPool) -> bool:
    """A vLLM whose condition counts its free queue itself (not get_num_free_blocks)."""
    if self.num_gpu_blocks - self.free_block_queue.num_free_blocks != 1:
        return False
    return _stock_reset_without_condition(self)


def _stock_reset_without_condition(self: BlockPool) -> bool:
    """A vLLM that resets with blocks in use (their hashes go; the requests keep their KV)."""
    self.cached_block_hash_to_block = type(self.cached_block_hash_to_block)()
    self.cached_block_hashes_by_block.clear()
    for block in self.blocks:
        block.reset_hash()
    return True


@pytest.mark.parametrize("reset", [_reset_checking_the_queue_only, _stock_reset_without_condition],
                         ids=["queue-only condition", "no condition"])
@pytest.mark.parametrize("in_use", [False, True], ids=["all free", "a request running"])
def test_another_vllms_reset_strands_no_block_outside_the_queue(monkeypatch: pytest.MonkeyPatch, reset: Any,
                                                                 in_use: bool) -> None:
    monkeypatch.setattr(BlockPool, "reset_prefix_cache", reset)
    cache = Cache(16)
    _retained_and_pinned(cache)
    running = cache.admit("c1", tokens(2, 2 * BLOCK_SIZE), "c") if in_use else None
    before = _state(cache)
    ok = cache.pool.reset_prefix_cache()
    if ok:
        _assert_cleared(cache)
    else:
        assert _state(cache) == before
    assert ok is (reset is _stock_reset_without_condition or not in_use)
    if running is not None:
        cache.free(running)
        check_filing(cache.pool, cache.core, cache.adapter)


def _step_boundary(cache: Cache) -> None:
    """What KvHintScheduler.schedule does before vLLM's: expiry, queued hints, the retention
    order's mode; and the carried removals reported."""
    cache.boundary()
    cache.core.run_pending()
    cache.pool.kvh_sync_mode()


pressure = st.tuples(st.just("pressure"), st.integers(1, 6))
hint = st.tuples(st.just("hint"), st.sampled_from(["retain", "pin", "release"]), st.sampled_from(SESSIONS),
                 st.integers(0, 3), st.floats(1.0, 60.0))
reset = st.tuples(st.just("reset"))
operations = st.lists(st.one_of(admit, admit, admit, free, decode, pressure, hint, hint, tick, reset, reset), min_size=3, max_size=30)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations)
def test_resets_amid_traffic_and_hints_clear_everything_or_change_nothing(ops: list[tuple]) -> None:
    cache = Cache(20)
    _retained_and_pinned(cache)  # every example starts with protected free blocks
    running: list[Any] = []
    for n, op in enumerate(ops):
        kind = op[0]
        if kind in ("admit", "free", "decode"):
            traffic_step(cache, n, op, running)
        elif kind == "pressure":
            k = min(op[1], cache.pool.get_num_free_blocks())
            if k:
                cache.pool.free_blocks(cache.pool.get_new_blocks(k))
        elif kind == "hint":
            _, action, sid, priority, ttl = op
            hint_of = {"retain": lambda: retain(session(sid), ttl, priority), "pin": lambda: pin(session(sid), ttl),
                       "release": lambda: release(session(sid))}[action]
            cache.apply(hint_of())
        elif kind == "tick":
            cache.clock.advance(op[1])
        else:
            _step_boundary(cache)  # resets come between steps (EngineCore's pause, an RPC)
            before = _state(cache)
            if cache.pool.reset_prefix_cache():
                assert not running
                _assert_cleared(cache)
            else:
                assert running, "vLLM refused a reset with every block free"
                assert _state(cache) == before
        _step_boundary(cache)
        check_filing(cache.pool, cache.core, cache.adapter, f"after {op}: ")
