"""KvHintHostPolicy: the host tier's eviction honours Retain and Pin (TierInfo.honours_retention).

vLLM 0.32's CPU offloading manager (host tier, G2) takes its eviction policy by
name from outside vLLM: kv_connector_extra_config
``{"eviction_policy": "KvHintHostPolicy", "cache_policy_module_path":
"engine_integration.tiers.host_policy"}``, which
`config.tier_kv_transfer_config(eviction_policy="kvhint")` and the launcher's
`--kvhint-tiers ...,host-eviction=kvhint` set (vLLM's LRU stays the default). The same keys
work with vLLM's built-in CUDA spec and with the tiering spec's primary tier.

The policy is vLLM's `LRUCachePolicy` with one change, in `evict`: when the
TierRuntime has attached a ranker (`attach`) and some hint is in effect, it
pops candidates in LRU order as the stock policy does, takes the ones no grant
protects, and sets the protected ones aside; only when the unprotected
candidates run out does it take protected ones, lowest `rank` first (ties in
LRU order), and puts the rest back. `rank(key)` is None for an unprotected
chunk, else a tuple (the proto's order: copies the device still holds, then
retained by priority and expected reuse, then pinned). With no hint in effect
(`active()` false) or no ranker, `evict` is the stock one.

Cost: one `rank` call per candidate popped while hints are in effect, and a
sort of the protected candidates only when they are needed; nothing otherwise.
Runs on the engine thread (the connector's scheduler side), as the ranker does.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

Rank = Callable[[OffloadKey], "tuple[float, ...] | None"]


class KvHintHostPolicy(LRUCachePolicy):
    """LRU, except that chunks a hint protects go last, in `rank` order (module doc)."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._rank: Rank | None = None
        self._active: Callable[[], bool] = lambda: False

    def attach(self, rank: Rank, active: Callable[[], bool]) -> None:
        """Called once by the TierRuntime: `rank(key)` (None: unprotected) and `active()`
        (whether any hint is in effect; when not, eviction is the stock LRU)."""
        self._rank = rank
        self._active = active

    @property
    def attached(self) -> bool:
        return self._rank is not None

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        rank = self._rank
        if n == 0 or rank is None or not self._active():
            return super().evict(n, protected)
        selected: list[tuple[int, OffloadKey]] = []
        seen: set[OffloadKey] = set()
        deferred: list[tuple[int, OffloadKey]] = []  # in the caller's protected set: never evicted here
        held: list[tuple[tuple[float, ...], tuple[int, OffloadKey]]] = []  # hint-protected candidates
        while self._heap and len(selected) < n:
            entry = heapq.heappop(self._heap)
            if not self._is_current(entry):
                continue
            key = entry[1]
            if key in seen:
                continue  # an equivalent lazy entry (see LRUCachePolicy.evict)
            seen.add(key)
            if key in protected:
                deferred.append(entry)
                continue
            r = rank(key)
            if r is None:
                selected.append(entry)
            else:
                held.append((r, entry))
        if len(selected) < n:
            held.sort(key=lambda re: (re[0], re[1][0]))  # rank, then LRU order
            need = n - len(selected)
            if len(held) < need:
                for entry in selected + deferred + [e for _, e in held]:
                    heapq.heappush(self._heap, entry)
                return None
            selected += [e for _, e in held[:need]]
            held = held[need:]
        for entry in deferred + [e for _, e in held]:
            heapq.heappush(self._heap, entry)
        out: list[tuple[OffloadKey, ChunkStatus]] = []
        for _, key in selected:
            chunk = self.chunks[key]
            assert chunk.ref_cnt == 0
            self._evictable.remove(key)
            del self.chunks[key]
            del self._ranks[key]
            out.append((key, chunk))
        self._maybe_compact_heap()
        return out
