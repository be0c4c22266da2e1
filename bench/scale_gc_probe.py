"""Where bench.scale's garbage-collection cost lands: the collections that run during each side's
steps, per generation, on one stock/KvHint pair (16384 blocks, 10000 sessions by default).

    python -m bench.scale_gc_probe [--pool 16384] [--sessions 10000] [--steps 100]

A diagnostic printed to stdout, not a results table. The pair is filled and warmed as in
bench.scale (`scale_driver.Pair.fill_and_freeze`: the heap is frozen after the fill, as
EngineCore freezes its start-up heap); then every collection during the measured steps is timed
(`gc.callbacks`) and charged to the side whose step was running. Both sides live in one process, so a young
collection that KvHint's allocations trigger also traverses the young objects of the stock side:
what lands on KvHint here is an upper bound of what it would cost alone.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from typing import Any

from .scale_driver import Pair
from .scale_workload import Shape


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scale_gc_probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pool", type=int, default=16384)
    ap.add_argument("--sessions", type=int, default=10000)
    ap.add_argument("--steps", type=int, default=100)
    a = ap.parse_args(argv)
    shape = Shape(a.pool, a.sessions, steps=a.steps)
    pair = Pair(shape)
    try:
        pair.fill_and_freeze()
        pair.steps(shape.warmup_steps, "warmup")
        pair.units.clear()
        running: dict[str, str | None] = {"side": None}
        spent: dict[tuple[str | None, int], list[int]] = {}
        started = [0]

        def on_gc(phase: str, info: dict[str, Any]) -> None:
            if phase == "start":
                started[0] = time.perf_counter_ns()
            else:
                spent.setdefault((running["side"], info["generation"]), []).append(time.perf_counter_ns() - started[0])

        for side in (pair.stock, pair.kv):
            step = side.step

            def timed(turns: Any, step: Any = step, name: str = side.name) -> Any:
                running["side"] = name
                try:
                    return step(turns)
                finally:
                    running["side"] = None

            side.step = timed  # type: ignore[method-assign]
        gc.callbacks.append(on_gc)
        try:
            pair.steps(a.steps, "steady")
        finally:
            gc.callbacks.remove(on_gc)
        units = pair.units
        stock = sum(u.stock_ns for u in units)
        kv = sum(u.kv_ns for u in units)
        print(f"{shape.label}; {len(units)} steps")
        print(f"median of per-step ratios {statistics.median(u.kv_ns / u.stock_ns for u in units):.3f}x, "
              f"ratio of totals {kv / stock:.3f}x, KvHint - stock {(kv - stock) / len(units) / 1e3:.0f} us per step")
        for (side, generation), times in sorted(spent.items(), key=str):
            print(f"  during {side or 'neither'} steps: generation {generation}: {len(times)} collections, "
                  f"{sum(times) / len(times) / 1e6:.2f} ms each, {sum(times) / len(units) / 1e3:.0f} us per step")
    finally:
        pair.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
