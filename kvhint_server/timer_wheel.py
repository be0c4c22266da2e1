"""A hashed timer wheel for TTL deadlines.

schedule/cancel are O(1); advance(now) costs O(elapsed ticks + entries due),
bounded by one pass over the wheel however long the gap since the last call.
Rescheduling a key replaces its deadline (stale entries are skipped lazily).
Callers must not rely on the wheel for correctness at a deadline: they check
deadlines themselves (a missed tick only delays proactive cleanup).
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class TimerWheel(Generic[K]):
    def __init__(self, tick_s: float = 0.05, slots: int = 1024, start: float = 0.0) -> None:
        if tick_s <= 0 or slots <= 0:
            raise ValueError("tick_s and slots must be positive")
        self._tick_s = tick_s
        self._slots: list[list[tuple[int, float, K]]] = [[] for _ in range(slots)]
        self._deadline: dict[K, float] = {}
        self._processed_tick = self._tick_of(start) - 1

    def _tick_of(self, t: float) -> int:
        return math.floor(t / self._tick_s)

    def __len__(self) -> int:
        return len(self._deadline)

    def __contains__(self, key: object) -> bool:
        return key in self._deadline

    def deadline(self, key: K) -> float | None:
        return self._deadline.get(key)

    def schedule(self, key: K, deadline: float) -> None:
        tick = max(self._tick_of(deadline), self._processed_tick + 1)
        self._deadline[key] = deadline
        self._slots[tick % len(self._slots)].append((tick, deadline, key))

    def cancel(self, key: K) -> None:
        self._deadline.pop(key, None)

    def advance(self, now: float) -> list[K]:
        """Remove and return the keys whose deadline is <= now."""
        target = self._tick_of(now)
        if not self._deadline:
            self._processed_tick = max(self._processed_tick, target - 1)
            return []
        n = len(self._slots)
        first = self._processed_tick + 1
        ticks = range(first, target + 1) if target - first < n else range(target - n + 1, target + 1)
        due: list[K] = []
        for tick in ticks:
            slot = self._slots[tick % n]
            if not slot:
                continue
            keep: list[tuple[int, float, K]] = []
            for entry in slot:
                entry_tick, deadline, key = entry
                if self._deadline.get(key) != deadline:
                    continue  # cancelled or rescheduled
                if entry_tick <= target and deadline <= now:
                    del self._deadline[key]
                    due.append(key)
                else:
                    keep.append(entry)
            self._slots[tick % n] = keep
        # The current tick may still hold entries due later within it.
        self._processed_tick = target - 1
        return due
