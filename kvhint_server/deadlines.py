"""Deadlines for TTL expiry: a min-heap with lazy cancellation.

`schedule` is O(log n) and `cancel` O(1); `advance(now)` costs O(1) when nothing is due and
O(log n) per due (or stale) entry otherwise, whatever the number of keys scheduled. Rescheduling
a key replaces its deadline: the old heap entry stays until it surfaces and is skipped, and the
heap is rebuilt from the live deadlines when stale entries outnumber live ones.

This replaced a hashed timer wheel (1024 slots of 50 ms) whose `advance` rescanned every entry
of the current slot, those of later revolutions included, at each call: with 10^5 grants that
was about 14 us per call, and the engine calls it at every step boundary and before every
reclaim (bench/scale's hints run, quiet steps). Callers must not rely on it for correctness at
a deadline: they check deadlines themselves (it only drives proactive cleanup).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class DeadlineQueue(Generic[K]):
    def __init__(self, compact_slack: int = 1024) -> None:
        if compact_slack < 0:
            raise ValueError("compact_slack must be >= 0")
        # Stale entries tolerated on top of the live ones before the heap is rebuilt.
        self._slack = compact_slack
        # (deadline, tie-breaker, key); keys need not be orderable.
        self._heap: list[tuple[float, int, K]] = []
        self._deadline: dict[K, float] = {}
        self._order = itertools.count()
        # No key is due before this: the heap's earliest entry (a stale one included), or inf.
        # A plain attribute, so that a hot path can skip `advance` without a call.
        self.earliest = math.inf

    def __len__(self) -> int:
        return len(self._deadline)

    def __contains__(self, key: object) -> bool:
        return key in self._deadline

    def deadline(self, key: K) -> float | None:
        return self._deadline.get(key)

    def schedule(self, key: K, deadline: float) -> None:
        self._deadline[key] = deadline
        heapq.heappush(self._heap, (deadline, next(self._order), key))
        if deadline < self.earliest:
            self.earliest = deadline
        self._maybe_compact()

    def cancel(self, key: K) -> None:
        if self._deadline.pop(key, None) is not None:
            self._maybe_compact()

    def advance(self, now: float) -> list[K]:
        """Remove and return the keys whose deadline is <= now, earliest first."""
        heap = self._heap
        if self.earliest > now:
            return []
        live = self._deadline
        due: list[K] = []
        pop = heapq.heappop
        while heap and heap[0][0] <= now:
            deadline, _, key = pop(heap)
            if live.get(key) == deadline:  # else cancelled or rescheduled
                del live[key]
                due.append(key)
        self.earliest = heap[0][0] if heap else math.inf
        # Keys leaving can leave their stale entries (a rescheduled key's older ones) over the bound.
        self._maybe_compact()
        return due

    def heap_entries(self) -> int:
        """Heap entries, stale ones included (bounded by 2 x live + compact_slack + 1)."""
        return len(self._heap)

    def _maybe_compact(self) -> None:
        # A rebuild costs O(live) and follows at least live + slack stale entries: O(1) amortized.
        if len(self._heap) > 2 * len(self._deadline) + self._slack:
            order = self._order
            self._heap = [(d, next(order), k) for k, d in self._deadline.items()]
            heapq.heapify(self._heap)
            self.earliest = self._heap[0][0] if self._heap else math.inf
