"""The host tier's eviction policy (engine_integration.tiers.host_policy) inside vLLM's real
CPUOffloadingManager, loaded by name the way the connector loads it (no engine, no model):
with no hint in effect it evicts exactly as vLLM's LRU policy; with hints, protected chunks go
last, in the ranker's order, and the manager's own protected set is still respected."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from engine_integration import vllm_private
from engine_integration.tiers.config import HOST_POLICY_MODULE, HOST_POLICY_NAME
from engine_integration.tiers.host_policy import KvHintHostPolicy
from vllm.v1.kv_offload.base import ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager


def key(i: int) -> Any:
    return make_offload_key(i.to_bytes(32, "big"), 0)


class Host:
    """A CPUOffloadingManager of `chunks` chunks; `store` runs one request's store to completion."""

    def __init__(self, chunks: int, policy: str = HOST_POLICY_NAME) -> None:
        module = HOST_POLICY_MODULE if policy == HOST_POLICY_NAME else None
        self.m = CPUOffloadingManager(num_chunks=chunks, cache_policy=policy, cache_policy_module_path=module)
        self.policy = vllm_private.host_cache_policy(self.m)
        self.ranks: dict[Any, tuple[float, ...]] = {}
        self.active = False
        self._n = 0

    def attach(self) -> None:
        self.policy.attach(lambda k: self.ranks.get(k), lambda: self.active)

    def store(self, *ids: int) -> list[int] | None:
        """Evicted ids, or None when the manager refused the store."""
        self._n += 1
        ctx = ReqContext(req_id=f"r{self._n}")
        self.m.on_new_request(ctx)
        keys = [key(i) for i in ids]
        out = self.m.prepare_store(keys, ctx)
        if out is not None:
            self.m.complete_store(out.keys_to_store, ctx)
        self.m.on_request_finished(ctx)
        return None if out is None else [int.from_bytes(k[:-4], "big") for k in out.evicted_keys]

    def held(self) -> set[int]:
        return {int.from_bytes(k[:-4], "big") for k in self.policy.chunks}


def test_the_config_names_load_the_policy_through_vllms_factory() -> None:
    host = Host(4)
    assert isinstance(host.policy, KvHintHostPolicy) and not host.policy.attached
    host.attach()
    assert host.policy.attached


def test_protected_chunks_go_last_in_rank_order() -> None:
    host = Host(4)
    host.attach()
    for i in (1, 2, 3, 4):
        host.store(i)
    host.active = True
    host.ranks = {key(1): (1, 5, 0, 0.0), key(2): (2, 0, 0, 0.0)}  # 1 retained (priority 5), 2 pinned
    assert host.store(5) == [3]  # LRU would take 1: the oldest unprotected chunk goes instead
    assert host.store(6) == [4]
    host.ranks |= {key(5): (0,), key(6): (1, 1, 0, 0.0)}  # 5: the device still holds it; 6: priority 1
    assert host.store(7) == [5]  # every candidate protected: lowest rank first
    assert host.store(8) == [7]  # 7 is not protected
    assert host.store(9, 10) == [8, 6]  # 8 (unprotected), then 6 (priority 1) before 1 (priority 5)
    assert host.store(11, 12, 13) == [10, 9, 1]  # (vLLM ranks a request's keys tail first) the retained 1 before the pinned 2
    host.active = False  # no hint in effect: stock LRU, protection or not
    assert host.store(14) == [2]
    assert host.held() == {11, 12, 13, 14}

def test_expected_reuse_orders_within_a_priority() -> None:
    host = Host(3)
    host.attach()
    for i in (1, 2, 3):
        host.store(i)
    host.active = True
    host.ranks = {key(1): (1, 0, 1, -50.0), key(2): (1, 0, 1, -90.0), key(3): (1, 0, 0, 0.0)}
    # No (or a passed) expectation first, then the furthest expected reuse (90 before 50).
    assert host.store(4, 5, 6) == [3, 2, 1]


def test_the_managers_protected_set_is_never_evicted() -> None:
    host = Host(2)
    host.attach()
    host.store(1)
    host.store(2)
    host.active = True
    host.ranks = {key(2): (1, 0, 0, 0.0)}
    # Storing 1 again with a new 3: 1 is in the request (the manager protects it), so only 2 can go.
    assert host.store(1, 3) == [2]
    assert host.store(1, 3, 4) is None  # nothing evictable outside the request: refused, state unchanged
    assert host.held() == {1, 3}


ops = st.lists(
    st.tuples(st.lists(st.integers(0, 11), min_size=1, max_size=3, unique=True),
              # few distinct ranks, so protected chunks often tie and LRU decides among them
              st.dictionaries(st.integers(0, 11), st.sampled_from([(0,), (1, -1), (1, 3), (2, 0)]), max_size=8),
              st.booleans()),
    min_size=1, max_size=30,
)


@settings(max_examples=80, deadline=None)
@given(ops)
def test_inactive_is_exactly_lru_and_active_takes_unprotected_first(sequence: list[Any]) -> None:
    """Against vLLM's own LRU policy run on the same stores: the same evictions whenever no hint is
    in effect; with hints, every eviction takes unprotected chunks before protected ones, and
    protected ones lowest rank first (ties: least recently used first)."""
    ours, stock = Host(5), Host(5, "lru")
    ours.attach()
    for ids, ranks, active in sequence:
        ours.active = active
        ours.ranks = {key(i): r for i, r in ranks.items()}
        before = {k: (ours.ranks.get(k), ours.policy._ranks[k]) for k in ours.policy._evictable}
        got = ours.store(*ids)
        if not active:
            assert got == stock.store(*ids)
            assert ours.held() == stock.held()
            continue
        if got is not None:
            request = {key(i) for i in ids}
            candidates = sorted(((r is not None, r or (), lru), k) for k, (r, lru) in before.items() if k not in request)
            assert [int.from_bytes(k[:-4], "big") for _, k in candidates[: len(got)]] == got
        stock = _twin(ours)  # the stock twin holds what ours holds, in the same recency order


def _twin(host: Host) -> Host:
    """A stock-LRU host holding what `host` holds, in the same recency order."""
    twin = Host(5, "lru")
    for k in sorted(host.policy.chunks, key=lambda k: host.policy._ranks[k]):
        twin.store(int.from_bytes(k[:-4], "big"))
    return twin

