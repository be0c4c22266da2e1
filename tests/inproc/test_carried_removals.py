"""The allocation fast path carries its removals to the step's next report.

With nothing retained, `KvHintBlockPool.get_new_blocks` adds the keys it evicts to the
adapter's carry instead of reporting each allocation's (VllmAdapter.flush_removed). They are
reported before the next store, before any other report or booking, and at the step
boundary (KvHintScheduler.schedule / update_from_output; `Cache.boundary` here). What a
WatchEvents consumer sees: a step's evictions between two stores come as one BlocksRemoved,
and KvHint's stream is still vLLM's own KV events, hash for hash, in vLLM's order.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from pool_support import BLOCK_SIZE, Cache, _external, tokens
from test_pool_hooks_stock import operations, step

from engine_integration.kv_groups import residency_view
from kvhint_server.events import BlocksRemoved, BlocksStored
from kvhint_server.model import RemovalCause

NUM_BLOCKS = 20


def _ours(cache: Cache, after: int = 0) -> list[tuple[str, bytes]]:
    return [
        ("stored" if isinstance(e.payload, BlocksStored) else "removed", h)
        for e in cache.core.bus.read_after(after, 100_000)
        if isinstance(e.payload, BlocksRemoved) or (isinstance(e.payload, BlocksStored) and not e.payload.prefix_hit)
        for h in e.payload.block_hashes
    ]


def _removals(cache: Cache, after: int) -> list[BlocksRemoved]:
    return [e.payload for e in cache.core.bus.read_after(after, 100_000) if isinstance(e.payload, BlocksRemoved)]


def _three_cached_chains(cache: Cache) -> list[list[bytes]]:
    chains = [cache.chain(cache.run(f"r{i}", tokens(i, 2 * BLOCK_SIZE), f"s{i}")) for i in range(3)]
    cache.take_removed()
    return chains


def test_a_steps_allocations_report_their_evictions_once_in_vllms_order() -> None:
    """Three allocations, each evicting cached blocks, with no store between them: reported
    together at the boundary (one report, split into BlocksRemoved events by session), with
    every evicted hash in the order vLLM evicted them."""
    cache = Cache(NUM_BLOCKS)
    chains = _three_cached_chains(cache)
    after = cache.core.bus.last_sequence
    uncached = cache.pool.get_num_free_blocks() - sum(map(len, chains))
    cache.allocate(uncached)  # the never-cached blocks first: nothing evicted
    for _ in chains:
        cache.allocate(2)  # one chain's two blocks each
    assert not _removals(cache, after)  # carried: nothing reported inside the step
    vllm_removed = cache.take_removed()  # the boundary
    assert sorted(vllm_removed) == sorted(h for chain in chains for h in chain)
    reports = _removals(cache, after)
    assert [h for r in reports for h in r.block_hashes] == vllm_removed
    assert {r.cause for r in reports} == {RemovalCause.EVICTED}
    assert cache.adapter._resident.isdisjoint(vllm_removed)


def test_a_block_evicted_and_stored_again_in_one_step_is_reported_removed_then_stored() -> None:
    """The store reports the carried removals first: a hash vLLM evicts and then caches again
    (the same tokens recomputed) in one step reads removed, then stored, as in vLLM's events,
    and stays resident."""
    cache = Cache(NUM_BLOCKS)
    chain = cache.chain(cache.run("a", tokens(0, 3 * BLOCK_SIZE), "s"))
    cache.take_removed()
    after = cache.core.bus.last_sequence
    taken = cache.pool.get_new_blocks(cache.pool.get_num_free_blocks())  # evicts a's blocks (carried)
    cache.pool.free_blocks(taken)  # back, uncached: room to compute a's prompt again
    again = cache.admit("a2", tokens(0, 3 * BLOCK_SIZE), "s")
    assert again is not None and again.hit_tokens == 0
    vllm_removed = cache.take_removed()
    assert vllm_removed == chain[::-1] or sorted(vllm_removed) == sorted(chain)
    ours = _ours(cache, after)
    assert ours == [("removed", h) for h in vllm_removed] + [("stored", h) for h in chain]
    assert set(chain) <= cache.adapter._resident


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations)
def test_carried_removals_keep_vllms_event_order(ops: list[tuple]) -> None:
    """Any run of admissions (shared prefixes), decode steps, frees and allocation pressure
    as one step, the boundary only at its end: KvHint's stored/removed stream is vLLM's own
    KV events, hash for hash, in order (removals of a copy that leaves another cached left
    out: KvHint reports blocks, not copies)."""
    cache = Cache(NUM_BLOCKS)
    running: list = []
    vllm_events: list[Any] = []
    for n, op in enumerate(ops):
        step(cache, running, op, n)
        vllm_events += cache.pool.take_events()
    cache.boundary()
    theirs = [(kind, _external(h)) for kind, h, _ in residency_view(vllm_events, {0})]
    assert _ours(cache) == theirs
    assert not cache.adapter._carried


def test_with_lower_tiers_each_allocation_reports_its_removals_at_once() -> None:
    """With a host tier attached, the tier runtime books device and host changes in its own
    order, so nothing is carried: an allocation's evictions are booked when it returns."""
    import tier_support

    from kvhint_server.events import BlocksRemoved as Removed

    with tier_support.tiered(hybrid=False) as s:
        for i in range(3):
            tier_support.run(s, f"r{i}", tokens(i, 32), f"s{i}")
        pool, core = s.kv_cache_manager.block_pool, s.kvhint_core
        assert pool._kvh_carry is None
        after = core.bus.last_sequence
        cached = len(pool.cached_block_hash_to_block._cache)
        pool.get_new_blocks(pool.get_num_free_blocks())  # every free block: the cached ones evicted
        assert cached and not pool.cached_block_hash_to_block._cache
        removed = [h for e in core.bus.read_after(after, 100_000) if isinstance(e.payload, Removed) for h in e.payload.block_hashes]
        assert len(removed) == cached and not s.kvhint_adapter._carried
