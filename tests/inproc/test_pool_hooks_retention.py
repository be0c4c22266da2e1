"""Retention on vLLM's real BlockPool: what Retain, Pin, Release, TTL expiry and
Evict do to the order in which free cached blocks are evicted.

Hints go through the ApplyHints path (validation + HintExecutor) into the
VllmAdapter and the hooked pool; eviction order is read from vLLM's own
BlockRemoved events while the pool is drained by allocations.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pool_support import BLOCK_SIZE, Cache, evict, hashes, pin, release, retain, session, tokens

from kvhint_server.model import Outcome, Reason, RetentionClass


def drain(cache: Cache) -> list[bytes]:
    """Allocate every free block, one at a time; the removed hashes in eviction order.

    (Within one allocation every victim is evicted anyway; one block at a time
    shows the order in which the pool gives blocks up.)"""
    cache.take_removed()
    while cache.pool.get_num_free_blocks():
        cache.allocate(1)
    return cache.take_removed()


def tail_first(chain: list[bytes]) -> list[bytes]:
    return list(reversed(chain))


# ---------------------------------------------------------------- class order


@dataclass(frozen=True)
class Plan:
    """One session: a chain of `length` full blocks, its hint, and whether the
    hint arrives while the request is still running (filed when freed) or after."""

    length: int
    kind: str  # "ordinary" | "retain" | "pin"
    priority: int
    early: bool


plans = st.lists(
    st.builds(
        Plan,
        length=st.integers(1, 4),
        kind=st.sampled_from(["ordinary", "retain", "retain", "pin"]),
        priority=st.integers(-2, 3),
        early=st.booleans(),
    ),
    min_size=1,
    max_size=6,
)


def hint_for(plan: Plan, sid: str):
    return pin(session(sid)) if plan.kind == "pin" else retain(session(sid), priority=plan.priority)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plans)
def test_eviction_order_is_ordinary_then_retained_by_priority_then_pinned(plans):
    """Ordinary blocks go first (stock LRU order), then retained blocks by
    ascending priority (within a priority in the order they were filed, each
    chain tail first), then pinned blocks (pins broken under pressure)."""
    cache = Cache(64)
    filed: list[tuple[Plan, list[bytes]]] = []  # protected chains, in the order they were filed
    ordinary: list[bytes] = []
    late: list[tuple[Plan, str, list[bytes]]] = []
    for i, plan in enumerate(plans):
        sid = f"s{i}"
        admission = cache.admit(f"r{i}", tokens(i, plan.length * BLOCK_SIZE), sid)
        chain = cache.chain(admission)
        if plan.kind != "ordinary" and plan.early:
            [result] = cache.apply(hint_for(plan, sid))
            assert result.outcome is Outcome.ACCEPTED
        cache.free(admission)
        if plan.kind == "ordinary":
            ordinary += tail_first(chain)
        elif plan.early:
            filed.append((plan, tail_first(chain)))
        else:
            late.append((plan, sid, chain))
    for plan, sid, chain in late:
        [result] = cache.apply(hint_for(plan, sid))
        assert result.outcome is Outcome.ACCEPTED
        filed.append((plan, tail_first(chain)))
    retained = sorted((p for p in filed if p[0].kind == "retain"), key=lambda p: p[0].priority)
    pinned = [p for p in filed if p[0].kind == "pin"]
    expected = ordinary + [h for _, chain in retained + pinned for h in chain]
    assert drain(cache) == expected


def test_a_retained_chain_outlives_ordinary_blocks_freed_after_it(cache):
    kept = cache.run("kept", tokens(0, 4 * BLOCK_SIZE), "keep")
    [result] = cache.apply(retain(session("keep"), priority=1))
    assert result.outcome is Outcome.ACCEPTED and sum(result.affected.values()) == 4
    for i in range(1, 6):
        cache.run(f"filler{i}", tokens(i, 4 * BLOCK_SIZE))
    again = cache.admit("again", tokens(0, 4 * BLOCK_SIZE + 1), "keep")
    assert again.hit_tokens == 4 * BLOCK_SIZE
    assert all(cache.is_cached(h) for h in cache.chain(kept))


@pytest.mark.parametrize("grant", [retain, pin])
def test_a_protected_block_a_connector_invalidates_is_an_ordinary_free_block_again(cache, grant):
    """vLLM's `BlockPool.evict_blocks` (a KV connector invalidating blocks) drops the hash of a
    protected free block: it leaves the protected classes for the free queue's head, still free."""
    kept = cache.run("kept", tokens(0, 3 * BLOCK_SIZE), "keep")
    [result] = cache.apply(grant(session("keep")))
    assert result.outcome is Outcome.ACCEPTED and len(cache.filed()) == 3
    free_before = cache.pool.get_num_free_blocks()
    victim = kept.block_ids[1]
    cache.pool.evict_blocks({victim})
    assert victim not in cache.filed() and len(cache.filed()) == 2
    assert cache.free_queue()[0] == victim
    assert cache.pool.get_num_free_blocks() == free_before
    assert cache.pool.blocks[victim].block_hash is None


# ---------------------------------------------------------------- refile on grant, release, expiry


@pytest.mark.parametrize("grant", [retain, pin])
def test_grant_on_free_blocks_takes_them_out_of_the_lru_order(cache, grant):
    """The blocks are already free when the grant arrives: only the grant's refile protects them."""
    kept = cache.run("kept", tokens(0, 3 * BLOCK_SIZE), "keep")
    other = cache.run("other", tokens(1, 3 * BLOCK_SIZE), "other")
    [result] = cache.apply(grant(session("keep")))
    assert result.outcome is Outcome.ACCEPTED
    assert drain(cache) == tail_first(cache.chain(other)) + tail_first(cache.chain(kept))


def test_release_makes_retained_blocks_ordinary_again_even_when_shared(cache):
    """Release drops the protection of blocks another session also uses (no
    exclusive-block shortcut applies): they are evicted before a still-retained session."""
    cache.run("a", tokens(0, 2 * BLOCK_SIZE), "a")
    b = cache.run("b", tokens(0, 2 * BLOCK_SIZE) + tokens(1, BLOCK_SIZE), "b")
    c = cache.run("c", tokens(2, 2 * BLOCK_SIZE), "c")
    cache.apply(retain(session("a"), priority=5), retain(session("c"), priority=0))
    shared = cache.chain(b)[:2]
    assert len(cache.filed()) == 4
    [result] = cache.apply(release(session("a")))
    assert result.outcome is Outcome.ACCEPTED
    assert len(cache.filed()) == 2
    order = drain(cache)
    assert set(order[:3]) == {*shared, cache.chain(b)[2]}
    assert order[3:] == tail_first(cache.chain(c))


def test_release_of_explicit_hashes_unprotects_them(cache):
    kept = cache.run("kept", tokens(0, 3 * BLOCK_SIZE), "keep")
    other = cache.run("other", tokens(1, 2 * BLOCK_SIZE), "other")
    chain = cache.chain(kept)
    cache.apply(retain(hashes(chain)), retain(session("other")))
    [result] = cache.apply(release(hashes(chain)))
    assert result.outcome is Outcome.ACCEPTED
    order = drain(cache)
    assert set(order[:3]) == set(chain)
    assert order[3:] == tail_first(cache.chain(other))


@pytest.mark.parametrize("grant", [retain, pin])
def test_expired_grant_makes_its_blocks_ordinary_again(cache, grant):
    """Within the TTL the blocks survive pressure; after it they are evicted
    before ordinary blocks that were freed later (LRU again)."""
    kept = cache.run("kept", tokens(0, 3 * BLOCK_SIZE), "keep")
    [result] = cache.apply(grant(session("keep"), ttl_s=10))
    assert result.effective_ttl_s == 10
    later = cache.run("later", tokens(1, 3 * BLOCK_SIZE), "later")
    cache.clock.advance(5)
    cache.take_removed()
    everything_ordinary = cache.pool.get_new_blocks(cache.pool.free_block_queue.num_free_blocks)
    assert cache.take_removed() == tail_first(cache.chain(later))
    assert all(cache.is_cached(h) for h in cache.chain(kept))
    cache.pool.free_blocks(everything_ordinary)
    later2 = cache.run("later2", tokens(2, 3 * BLOCK_SIZE), "later")
    cache.clock.advance(6)
    order = drain(cache)  # the expiry is noticed under pressure, before victims are chosen
    assert set(order[:3]) == set(cache.chain(kept))
    assert set(order[3:]) == set(cache.chain(later2))


def test_expiry_at_a_step_boundary_refiles(cache):
    kept = cache.run("kept", tokens(0, 2 * BLOCK_SIZE), "keep")
    cache.apply(retain(session("keep"), ttl_s=10, priority=3))
    assert len(cache.filed()) == 2
    cache.clock.advance(11)
    cache.core.run_pending()
    assert cache.filed() == {}
    assert set(drain(cache)) == set(cache.chain(kept))


# ---------------------------------------------------------------- refile order: the tail first


def buckets(cache: Cache) -> list[tuple[RetentionClass, int]]:
    """(class, priority) of every protected free block, sorted."""
    return sorted(filing[:2] for filing in cache.filed().values())


SHARED = 6  # blocks of the shared prefix (a chance order of a set of six is the tail-first one 1 in 720 runs)


def shared_chains(cache: Cache, a_ttl_s: float = 60.0) -> tuple[list[bytes], list[bytes], bytes, bytes]:
    """Sessions a, b and c over one shared prefix S of SHARED blocks: a is S + two blocks of its
    own (A), b is S + one block y, c is a's whole chain + one block z and holds no grant (so A is
    in another session's prefix, and a Release must not demote it). b retains at priority 1,
    then a at priority 5 with `a_ttl_s`: S and A in bucket 5, y alone in bucket 1.
    Returns (S, A, y, z)."""
    prefix = tokens(0, SHARED * BLOCK_SIZE)
    a = cache.run("a", prefix + tokens(1, 2 * BLOCK_SIZE), "a")
    b = cache.run("b", prefix + tokens(2, BLOCK_SIZE), "b")
    c = cache.run("c", prefix + tokens(1, 2 * BLOCK_SIZE) + tokens(3, BLOCK_SIZE), "c")
    results = cache.apply(retain(session("b"), priority=1), retain(session("a"), priority=5, ttl_s=a_ttl_s))
    assert [r.outcome for r in results] == [Outcome.ACCEPTED, Outcome.ACCEPTED]
    shared, own, y, z = cache.chain(a)[:SHARED], cache.chain(a)[SHARED:], cache.chain(b)[-1], cache.chain(c)[-1]
    assert cache.chain(b)[:SHARED] == shared and cache.chain(c)[:-1] == shared + own
    assert buckets(cache) == [(RetentionClass.RETAINED, 1)] + [(RetentionClass.RETAINED, 5)] * (SHARED + 2)
    return shared, own, y, z


@pytest.mark.parametrize("noticed", ["under pressure", "at a step boundary"])
def test_expiry_over_a_lower_grant_refiles_the_chain_tail_first(cache, noticed):
    """a's priority-5 Retain expires over b's priority-1 Retain on the shared prefix: S joins b's
    bucket behind y, tail first, so pressure takes the tail before the root and b still resumes
    from the root. a's own blocks become ordinary and go first, also tail first."""
    shared, own, y, z = shared_chains(cache, a_ttl_s=10)
    cache.clock.advance(11)
    if noticed == "at a step boundary":
        cache.core.run_pending()
        assert buckets(cache) == [(RetentionClass.RETAINED, 1)] * (SHARED + 1)
    cache.take_removed()
    # Pressure, one block at a time: every block but the shared prefix's first four.
    taken = [cache.pool.get_new_blocks(1)[0] for _ in range(cache.pool.get_num_free_blocks() - (SHARED - 2))]
    assert cache.take_removed() == tail_first(own) + [z, y] + tail_first(shared)[:2]
    cache.pool.free_blocks(taken)
    resumed = cache.admit("b again", tokens(0, SHARED * BLOCK_SIZE) + tokens(2, BLOCK_SIZE + 1), "b")
    assert resumed is not None and resumed.hit_tokens == (SHARED - 2) * BLOCK_SIZE


def test_release_over_a_lower_grant_refiles_the_chain_tail_first(cache):
    """Release of a's higher Retain (its blocks come back as a set): S joins b's bucket tail
    first; A, in c's prefix and so not demoted, becomes ordinary at the queue's head, tail first."""
    shared, own, y, z = shared_chains(cache)
    [result] = cache.apply(release(session("a")))
    assert result.outcome is Outcome.ACCEPTED
    assert buckets(cache) == [(RetentionClass.RETAINED, 1)] * (SHARED + 1)
    assert drain(cache) == tail_first(own) + [z, y] + tail_first(shared)


def test_expired_blocks_that_become_ordinary_leave_the_tail_first(cache):
    """A grant with no other owner expires: its chain goes ahead of the ordinary blocks freed
    after it, tail first, as vLLM frees a request's blocks."""
    kept = cache.run("kept", tokens(0, SHARED * BLOCK_SIZE), "keep")
    [result] = cache.apply(retain(session("keep"), ttl_s=10, priority=3))
    assert result.outcome is Outcome.ACCEPTED
    later = cache.run("later", tokens(1, 3 * BLOCK_SIZE), "later")
    cache.clock.advance(11)
    assert drain(cache) == tail_first(cache.chain(kept)) + tail_first(cache.chain(later))


# ---------------------------------------------------------------- Evict


def test_evict_skips_blocks_in_use_and_frees_the_rest(cache):
    first = cache.run("first", tokens(0, 3 * BLOCK_SIZE), "s")
    running = cache.admit("running", tokens(0, 2 * BLOCK_SIZE) + tokens(1, 2 * BLOCK_SIZE), "s")
    assert running.hit_tokens == 2 * BLOCK_SIZE
    chain = cache.chain(first)
    in_use = chain[:2] + cache.chain(running)[2:]
    cache.take_removed()
    [result] = cache.apply(evict(session("s")))
    assert result.outcome is Outcome.CLIPPED and result.reason is Reason.BLOCKS_IN_USE
    assert [c.reason for c in result.clips] == [Reason.BLOCKS_IN_USE]
    assert result.clips[0].requested_blocks == 5 and result.clips[0].granted_blocks == 1
    assert sum(result.affected.values()) == 1
    assert cache.take_removed() == [chain[2]]
    assert not cache.is_cached(chain[2])
    assert all(cache.is_cached(h) for h in in_use)
    # The evicted block is the next one handed out.
    assert cache.free_queue()[0] == first.block_ids[2]


def test_evict_of_free_blocks_is_accepted_and_frees_them_first(cache):
    gone = cache.run("gone", tokens(0, 2 * BLOCK_SIZE), "gone")
    stay = cache.run("stay", tokens(1, 2 * BLOCK_SIZE), "stay")
    cache.apply(retain(session("gone"), priority=9))
    [result] = cache.apply(evict(session("gone")))
    assert result.outcome is Outcome.ACCEPTED and sum(result.affected.values()) == 2
    assert cache.take_removed() == tail_first(cache.chain(gone))
    assert set(cache.free_queue()[:2]) == set(gone.block_ids)
    assert all(cache.is_cached(h) for h in cache.chain(stay))
