"""The cost of the retention ledger's deadline structure per call, against the number of grants.

The engine asks for expired grants at every step boundary and before every reclaim of protected
blocks (`KvHintCore.expire_retention`), so that call must not grow with the number of grants
when nothing is due. This measures, side by side in one run:

  queue  `kvhint_server.deadlines.DeadlineQueue` (a min-heap with lazy cancellation), the
         structure in use;
  wheel  the hashed timer wheel it replaced (1024 slots of 50 ms, kept below as the rejected
         option), whose `advance` rescanned the current slot, entries of later revolutions
         included.

For n grants with deadlines spread uniformly over 300 s (a Retain TTL), starting 1000 s ahead
(nothing falls due), it times `advance` with the clock stepping 20 ms per call (a GPU step),
twice per step as the engine does, and `schedule` of one more key. Median over rounds.

  python -m bench.deadline_cost            # writes bench/results/deadline_cost.{md,json}
  python -m bench.deadline_cost --quick    # small, prints only
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import sys
import time
from collections.abc import Hashable
from pathlib import Path
from typing import Any, Generic, TypeVar

from bench.report import command_line, write_markdown
from kvhint_server.deadlines import DeadlineQueue

K = TypeVar("K", bound=Hashable)

OUT = "bench/results/deadline_cost"


class HashedWheel(Generic[K]):
    """The timer wheel the ledger used before (rejected: `advance` is O(entries per slot))."""

    def __init__(self, tick_s: float = 0.05, slots: int = 1024, start: float = 0.0) -> None:
        self._tick_s = tick_s
        self._slots: list[list[tuple[int, float, K]]] = [[] for _ in range(slots)]
        self._deadline: dict[K, float] = {}
        self._processed_tick = math.floor(start / tick_s) - 1

    def schedule(self, key: K, deadline: float) -> None:
        tick = max(math.floor(deadline / self._tick_s), self._processed_tick + 1)
        self._deadline[key] = deadline
        self._slots[tick % len(self._slots)].append((tick, deadline, key))

    def advance(self, now: float) -> list[K]:
        target = math.floor(now / self._tick_s)
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
            keep = []
            for entry in slot:
                entry_tick, deadline, key = entry
                if self._deadline.get(key) != deadline:
                    continue
                if entry_tick <= target and deadline <= now:
                    del self._deadline[key]
                    due.append(key)
                else:
                    keep.append(entry)
            self._slots[tick % n] = keep
        self._processed_tick = target - 1
        return due


def measure(kind: str, n: int, steps: int, rounds: int, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    s: Any = DeadlineQueue() if kind == "queue" else HashedWheel()
    for i in range(n):
        s.schedule(i, 1000.0 + rng.random() * 300.0)
    now = 0.0
    advance_us, schedule_us = [], []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(steps):
            now += 0.02
            s.advance(now)
            s.advance(now)
        advance_us.append((time.perf_counter() - t) / (2 * steps) * 1e6)
        t = time.perf_counter()
        for j in range(steps):
            s.schedule(n + j, 1000.0 + rng.random() * 300.0)
        schedule_us.append((time.perf_counter() - t) / steps * 1e6)
    return {"kind": kind, "grants": n, "advance_us": statistics.median(advance_us),
            "schedule_us": statistics.median(schedule_us)}


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    by = {(r["kind"], r["grants"]): r for r in rows}
    sizes = sorted({r["grants"] for r in rows})
    body = [
        "Nothing falls due (deadlines 1000 to 1300 s ahead); the clock steps 20 ms per engine step, two",
        "`advance` calls per step. Median over rounds, microseconds per call.",
        "",
        "| grants | queue: advance us | wheel (old): advance us | wheel / queue | queue: schedule us | wheel: schedule us |",
        "|---|---|---|---|---|---|",
    ]
    for n in sizes:
        q, w = by[("queue", n)], by[("wheel", n)]
        body.append(f"| {n} | {q['advance_us']:.2f} | {w['advance_us']:.2f} | {w['advance_us'] / q['advance_us']:.0f}x "
                    f"| {q['schedule_us']:.2f} | {w['schedule_us']:.2f} |")
    return body


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, print only")
    args = ap.parse_args(argv)
    sizes = (1_000, 10_000) if args.quick else (1_000, 10_000, 100_000, 1_000_000)
    steps, rounds = (200, 3) if args.quick else (1_000, 7)
    rows = []
    for n in sizes:
        for kind in ("queue", "wheel"):  # side by side, same n, same machine state
            rows.append(measure(kind, n, steps, rounds))
    body = markdown(rows)
    if args.quick:
        print("\n".join(body))
        return 0
    Path(OUT).parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": command_line("bench.deadline_cost", argv), "python": sys.version.split()[0],
            "machine": platform.machine(), "rows": rows}
    Path(OUT + ".json").write_text(json.dumps(meta, indent=1) + "\n")
    write_markdown(OUT + ".md", "Retention deadlines: cost per call against grants", "bench.deadline_cost", argv, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
