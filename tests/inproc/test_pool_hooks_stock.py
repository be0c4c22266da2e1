"""Without grants, the hooked BlockPool/KVCacheManager behave exactly like stock vLLM.

The same random sequence of admissions (with shared prefixes, so prefix hits
happen), decode steps, frees and allocation pressure runs on a stock
KVCacheManager and on one with the KvHint hooks installed. After every step
the two must agree on everything a request can observe: the blocks each
allocation got, the prefix hits, the free queue's eviction order, the cached
hashes and vLLM's own KV events (stored and removed, in order).
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pool_support import BLOCK_SIZE, Cache, _external, pin, release, retain, session, tokens

from engine_integration.hooks import KvHintBlockPool
from kvhint_server.events import BlocksStored

NUM_BLOCKS = 20

admit = st.tuples(
    st.just("admit"),
    st.integers(0, 3),  # shared prefix
    st.integers(0, 3 * BLOCK_SIZE),  # prefix length
    st.integers(0, 2 * BLOCK_SIZE + 1),  # own tokens
    st.sampled_from([None, "s0", "s1", "s2"]),
)
decode = st.tuples(st.just("decode"), st.integers(0, 7), st.integers(1, BLOCK_SIZE + 1))
free = st.tuples(st.just("free"), st.integers(0, 7))
pressure = st.tuples(st.just("pressure"), st.integers(1, 6))
operations = st.lists(st.one_of(admit, admit, decode, free, free, pressure), min_size=1, max_size=40)


def observe(cache: Cache) -> tuple:
    return cache.free_queue(), cache.cached(), cache.pool.get_num_free_blocks(), cache.pool.take_events()


def step(cache: Cache, running: list, op: tuple, n: int) -> object:
    """Apply one operation; returns what the caller saw."""
    kind = op[0]
    if kind == "admit":
        _, prefix, prefix_len, own, sid = op
        prompt = tokens(prefix, prefix_len) + [50_000 + 100 * n + i for i in range(own)]
        if not prompt:
            return "empty"
        admission = cache.admit(f"r{n}", prompt, sid)
        if admission is None:
            return None
        running.append(admission)
        return admission.hit_tokens, admission.block_ids
    if not running:
        return "idle"
    admission = running[op[1] % len(running)]
    if kind == "decode":
        return [cache.decode(admission, 7 + i) and list(admission.block_ids) for i in range(op[2])]
    if kind == "free":
        running.remove(admission)
        cache.free(admission)
        return "freed"
    blocks = cache.pool.get_new_blocks(min(op[1], cache.pool.get_num_free_blocks()))
    ids = [b.block_id for b in blocks]
    cache.pool.free_blocks(blocks)
    return ids


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations)
def test_hooks_without_grants_are_stock(ops):
    stock, hooked = Cache(NUM_BLOCKS, hooked=False), Cache(NUM_BLOCKS)
    assert isinstance(hooked.pool, KvHintBlockPool) and not isinstance(stock.pool, KvHintBlockPool)
    stock_running: list = []
    hooked_running: list = []
    stored_by_session = False
    for n, op in enumerate(ops):
        seen = step(stock, stock_running, op, n)
        assert step(hooked, hooked_running, op, n) == seen, f"step {n} {op}"
        assert observe(hooked) == observe(stock), f"after step {n} {op}"
        stored_by_session |= op[0] == "admit" and bool(op[4]) and isinstance(seen, tuple) and op[2] + op[3] >= BLOCK_SIZE
    # The hooks were live: a session's full blocks reached KvHint's event stream.
    published = [e.payload for e in hooked.core.bus.read_after(0, 100_000)]
    assert any(isinstance(p, BlocksStored) and p.coordinates.session_id for p in published) or not stored_by_session


def test_queue_order_of_ordinary_blocks_is_stock_while_a_grant_is_active():
    """With retention in effect (the hooks' other free path), ordinary blocks are
    queued exactly as stock vLLM queues them; only the protected ones are missing."""
    stock, hooked = Cache(NUM_BLOCKS, hooked=False), Cache(NUM_BLOCKS)
    for cache in (stock, hooked):
        cache.run("kept", tokens(0, 3 * BLOCK_SIZE), "keep")
    [granted] = hooked.apply(retain(session("keep")))
    assert granted.affected
    for cache in (stock, hooked):
        cache.run("a", tokens(1, 3 * BLOCK_SIZE + 2), "a")
        running = cache.admit("b", tokens(2, 2 * BLOCK_SIZE), "b")
        cache.run("c", tokens(1, 2 * BLOCK_SIZE) + tokens(3, BLOCK_SIZE + 1), None)
        cache.free(running)
    protected = set(hooked.filed())
    assert len(protected) == 3
    assert hooked.free_queue() == [b for b in stock.free_queue() if b not in protected]


def runs_stock_methods(cache: Cache) -> bool:
    """The pool's retention order is off: its retention overrides go straight to vLLM's code."""
    return type(cache.pool) is KvHintBlockPool and not cache.pool.kvh_retaining


def test_the_pool_runs_vllms_own_methods_while_nothing_is_retained():
    """The retention order is on only while a grant is in effect or a block is protected: a
    Retain switches it on before its outcome, and a Release, an expiry or a broken pin's
    eviction switches it off again."""
    cache = Cache(NUM_BLOCKS)
    assert runs_stock_methods(cache)
    cache.run("kept", tokens(0, 3 * BLOCK_SIZE), "keep")
    [granted] = cache.apply(retain(session("keep"), ttl_s=5.0))
    assert granted.affected
    assert not runs_stock_methods(cache)
    assert len(cache.filed()) == 3
    assert cache.pool.get_num_free_blocks() == NUM_BLOCKS - 1  # protected blocks still count as free
    cache.apply(release(session("keep")))
    assert not cache.filed() and runs_stock_methods(cache)

    # Expiry: the next allocation expires the grant and re-files its blocks.
    cache.run("second", tokens(1, 3 * BLOCK_SIZE), "second")
    [granted] = cache.apply(retain(session("second"), ttl_s=5.0))
    assert granted.affected and not runs_stock_methods(cache)
    cache.clock.advance(6.0)
    cache.allocate(1)
    assert not cache.filed() and runs_stock_methods(cache)

    # A pin broken under pressure: retaining until its blocks are gone and nothing else is held.
    cache.run("third", tokens(2, 3 * BLOCK_SIZE), "third")
    [pinned] = cache.apply(pin(session("third"), ttl_s=60.0))
    assert pinned.affected and not runs_stock_methods(cache)
    taken = cache.allocate(cache.pool.get_num_free_blocks())  # every free block, the pinned ones last
    assert len(taken) == NUM_BLOCKS - 2 and not cache.filed()  # all but the null block and the one taken above
    assert not cache.core.ledger.grants  # the broken pin's grant left with its blocks
    cache.pool.kvh_sync_mode()  # what KvHintScheduler.schedule() does at every step boundary
    assert runs_stock_methods(cache)


def test_an_allocation_that_expires_the_last_grant_reports_its_evictions():
    """The expiry at the start of an allocation can turn the retention order off; the same
    allocation then takes vLLM's path (the fast one), and the blocks it evicts, the expired
    grant's among them, reach KvHint's stream as vLLM's own events report them."""
    from kvhint_server.events import BlocksRemoved
    from kvhint_server.model import RemovalCause

    cache = Cache(NUM_BLOCKS)
    kept = cache.run("kept", tokens(0, 3 * BLOCK_SIZE), "keep")
    cache.run("other", tokens(1, 2 * BLOCK_SIZE), "other")
    [granted] = cache.apply(retain(session("keep"), ttl_s=5.0))
    assert granted.affected and not runs_stock_methods(cache)
    cache.take_removed()
    after = cache.core.bus.last_sequence
    cache.clock.advance(6.0)
    cache.allocate(cache.pool.get_num_free_blocks())  # every free block: all cached ones are evicted
    assert runs_stock_methods(cache) and not cache.filed()
    vllm_removed = cache.take_removed()
    assert set(cache.chain(kept)) <= set(vllm_removed)
    published = [e.payload for e in cache.core.bus.read_after(after, 100_000) if isinstance(e.payload, BlocksRemoved)]
    assert [h for p in published for h in p.block_hashes] == vllm_removed
    assert {p.cause for p in published} == {RemovalCause.EVICTED}


def test_with_a_grant_in_effect_an_allocation_evicts_in_its_own_loop_and_reports_a_granted_removal_at_once(monkeypatch):
    """The retention order on and no pin being broken: the queue holds no protected block, so
    the allocation runs vLLM's eviction step written into its loop (vLLM's per-block
    `_maybe_evict_cached_block` is not called). Removals of blocks without a grant are carried
    to the step's next report, as with nothing retained (one report for the step's
    allocations, in the order vLLM's own events list them); an allocation that reclaims
    retained blocks reports at once, since the report ends their grants, which the rest of the
    step must see."""
    from kvhint_server.model import RemovalCause

    cache = Cache(NUM_BLOCKS)
    kept = cache.run("kept", tokens(0, 3 * BLOCK_SIZE), "keep")
    other = cache.run("other", tokens(1, 4 * BLOCK_SIZE), "other")
    [granted] = cache.apply(retain(session("keep"), ttl_s=60.0))
    assert granted.affected and not runs_stock_methods(cache)
    cache.take_removed()
    per_block: list[object] = []
    monkeypatch.setattr(cache.pool, "_maybe_evict_cached_block", per_block.append)
    reports: list[tuple[list[bytes], RemovalCause]] = []
    report = cache.adapter._report_removed
    monkeypatch.setattr(cache.adapter, "_report_removed", lambda keys, cause: (reports.append((list(keys), cause)), report(keys, cause)))
    ordinary = cache.pool.free_block_queue.num_free_blocks
    taken = cache.allocate(ordinary // 2)
    taken += cache.allocate(ordinary - ordinary // 2)  # every ordinary block, in two allocations
    assert taken and not per_block
    assert not reports and cache.adapter._carried  # no grant among them: carried
    cache.adapter.flush_removed()  # what the step boundary (or the step's next store) does
    assert len(reports) == 1 and reports[0][1] is RemovalCause.EVICTED  # one report for both allocations
    vllm_removed = cache.take_removed()
    assert set(cache.chain(other)) <= set(vllm_removed)
    assert [_external(key[:-4]) for key in reports[0][0]] == vllm_removed  # keys: digest + group id
    assert all(cache.is_cached(h) for h in cache.chain(kept)) and len(cache.filed()) == 3

    # Past the ordinary queue: the retained blocks are reclaimed and evicted, and reported in the
    # allocation itself, their grants ended before it returns.
    reports.clear()
    cache.allocate(1)
    assert len(reports) == 1 and not cache.adapter._carried and not per_block
    [gone] = [_external(key[:-4]) for key in reports[0][0]]
    assert gone in cache.chain(kept) and gone not in cache.core.ledger.grants and not cache.is_cached(gone)
