"""Expected reuse on vLLM's real BlockPool (no engine): which retained session a
memory shortfall evicts first.

Three sessions of three blocks each are retained at the same priority. Under
pressure vLLM must evict the session expected back furthest in the future
first; without expectations it evicts in LRU order exactly as before; an
overdue expectation protects nothing beyond LRU; and a block shared by two
sessions is kept for the earlier of their expectations.
"""

from __future__ import annotations

from google.protobuf import duration_pb2
from pool_support import Cache, session, tokens

from kvhint.v1 import kvhint_pb2 as pb
from kvhint_server.model import Outcome

BLOCKS_PER_SESSION = 3
TOKENS = 4 * BLOCKS_PER_SESSION


def _duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(round(seconds * 1e9))
    return d


def retain(session_id: str, reuse_in: float | None, ttl: float = 600.0) -> pb.Hint:
    action = pb.RetainAction(priority=1, ttl=_duration(ttl))
    if reuse_in is not None:
        action.expected_reuse_in.CopyFrom(_duration(reuse_in))
    return pb.Hint(selector=session(session_id), retain=action)


def _setup(expectations: dict[str, float | None], prompts: dict[str, list[int]] | None = None) -> tuple[Cache, dict[str, list[bytes]]]:
    cache = Cache(num_blocks=16)
    chains = {}
    for i, name in enumerate(expectations):
        prompt = (prompts or {}).get(name) or tokens(i, TOKENS)
        chains[name] = cache.chain(cache.run(f"r-{name}", prompt, session=name))
    results = cache.apply(*(retain(name, reuse) for name, reuse in expectations.items()))
    assert [r.outcome for r in results] == [Outcome.ACCEPTED] * len(expectations), results
    cache.allocate(len(cache.free_queue()))  # the ordinary free blocks go first
    return cache, chains


def _evicted_order(cache: Cache, chains: dict[str, list[bytes]]) -> list[str]:
    """Apply pressure one session's worth at a time; the sessions in the order they lost their blocks."""
    order = []
    while len(order) < len(chains):
        cache.allocate(BLOCKS_PER_SESSION)
        gone = [name for name, chain in chains.items() if name not in order and not any(cache.is_cached(h) for h in chain)]
        assert len(gone) == 1, f"expected one whole session evicted, got {gone}"
        order += gone
    return order


def test_furthest_expected_reuse_is_evicted_first() -> None:
    cache, chains = _setup({"a": 10.0, "b": 100.0, "c": 50.0})
    assert _evicted_order(cache, chains) == ["b", "c", "a"]


def test_without_expectations_the_order_is_lru() -> None:
    cache, chains = _setup({"a": None, "b": None, "c": None})
    assert _evicted_order(cache, chains) == ["a", "b", "c"]


def test_overdue_expectation_falls_back_to_lru() -> None:
    cache, chains = _setup({"a": 10.0, "b": 100.0, "c": None})
    cache.clock.advance(20.0)  # a is overdue: it joins c in LRU order, ahead of it; b is still ahead
    assert _evicted_order(cache, chains) == ["a", "c", "b"]


def test_shared_blocks_keep_the_earliest_expectation() -> None:
    shared = tokens(7, 8)  # a and b share their first two blocks
    prompts = {"a": shared + tokens(8, 4), "b": shared + tokens(9, 4), "c": tokens(10, TOKENS)}
    cache, chains = _setup({"a": 200.0, "b": 5.0, "c": 100.0}, prompts)
    cache.allocate(BLOCKS_PER_SESSION)
    # a's own tail block goes first (200 s); the shared blocks are due at 5 s, so c's blocks (100 s) go next.
    assert not cache.is_cached(chains["a"][2])
    assert all(cache.is_cached(h) for h in chains["b"])
    assert sum(cache.is_cached(h) for h in chains["c"]) == 1
