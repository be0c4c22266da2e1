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
retained by priority and expected reuse, then pinned). On a hybrid model
(`residency_keys` attached) a protected window copy taken while its block's
full-attention copy is a protected candidate left swaps places with it
(`_residency_first`). With no hint in effect (`active()` false) or no ranker,
`evict` is the stock one.

Cost: one `rank` call per candidate popped while hints are in effect, and a
sort of the protected candidates only when they are needed; nothing otherwise.
Runs on the engine thread (the connector's scheduler side), as the ranker does.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

Rank = Callable[[OffloadKey], "tuple[float, ...] | None"]
ResidencyKeys = Callable[[OffloadKey], "Sequence[OffloadKey]"]
Held = tuple["tuple[float, ...]", "tuple[int, OffloadKey]"]  # (rank, heap entry)


class KvHintHostPolicy(LRUCachePolicy):
    """LRU, except that chunks a hint protects go last, in `rank` order (module doc)."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._rank: Rank | None = None
        self._active: Callable[[], bool] = lambda: False
        self._residency_keys: ResidencyKeys | None = None

    def attach(self, rank: Rank, active: Callable[[], bool], residency_keys: ResidencyKeys | None = None) -> None:
        """Called once by the TierRuntime: `rank(key)` (None: unprotected) and `active()`
        (whether any hint is in effect; when not, eviction is the stock LRU).
        `residency_keys(key)`, on a model with groups that do not define residency (hybrid):
        the keys of the same logical block's copies in the groups that do, for a copy in
        another group (a window tail), else empty (see `_residency_first`)."""
        self._rank = rank
        self._active = active
        self._residency_keys = residency_keys

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
            chosen, held = held[:need], held[need:]
            if self._residency_keys is not None:
                self._residency_first(chosen, held)
            selected += [e for _, e in chosen]
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

    def _residency_first(self, chosen: list[Held], rest: list[Held]) -> None:
        """In place: a chosen protected copy in a group that does not define residency (a
        window tail) whose logical block's residency copy is among the protected candidates
        left in `rest` swaps places with it, so the residency copy goes instead. Every group's
        copy of a block ranks as the block and ties go in LRU order, in which vLLM's offloading
        puts a block's copy in a higher group id first; so the tier took a retained block's
        window copy and kept its full-attention copy, and with it the block's presence on the
        tier and its grant, while a resume from the tier found no window tail. With the
        residency copy gone the block leaves the tier, which ends the grant when no other tier
        holds it and unprotects the window copy left (the device's rule:
        VllmAdapter.residency_copies_first)."""
        residency_keys = self._residency_keys
        assert residency_keys is not None
        where = {entry[1]: j for j, (_, entry) in enumerate(rest)}
        for i, (_, entry) in enumerate(chosen):
            for sibling in residency_keys(entry[1]):
                j = where.pop(sibling, None)
                if j is not None:
                    chosen[i], rest[j] = rest[j], chosen[i]
                    break

