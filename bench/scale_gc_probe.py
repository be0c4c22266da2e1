"""Where bench.scale's garbage-collection cost lands: the collections that run during each side's
steps, per generation, on one stock/KvHint pair (16384 blocks, 10000 sessions by default), and
what each side's steps leave in the collector's young generation.

    python -m bench.scale_gc_probe [--pool 16384] [--sessions 10000] [--steps 150] [--bookkeeping deferred]
                                   [--no-settler-gc] [--aa] [--freeze-before-fill]
                                   [--out bench/results/scale_gc_probe.md]

The pair is filled and warmed as in bench.scale (`scale_driver.Pair.fill_and_freeze`: the heap is
frozen after the fill, as EngineCore freezes its start-up heap). Then two passes of `--steps`
steps each, and with deferred bookkeeping a third of at most 100:

* **Where collections land.** Every collection is timed (`gc.callbacks`) and charged to the side
  whose step was running (or to neither: the driver between steps, and deferred settling).
* **Young objects left per step.** With the collector off for the timed region only, the change
  of the young generation's allocation count (`gc.get_count()[0]`) across each side's step and
  across the KvHint side's settle. A young collection runs when that count passes its threshold
  (700), so a side whose steps leave objects alive raises the chance that the crossing, and the
  collection's cost, lands in its steps.
* **What the settle leaves alive** (`census_pass`): the tracked objects each deferred settle
  made and still references, by type. Such objects outlive the young collections, so they are
  what reaches the oldest generation and drives full collections.

With deferred bookkeeping the driver settles the journal between steps as the settler thread
does, including its young collection (`ResidencyJournal.collect_young`); `--no-settler-gc`
leaves that collection out, so the collections land where CPython's own trigger puts them.

`--aa` runs the same passes on a stock/stock pair (the second side, "stock-b", in KvHint's place):
the process's own collections without KvHint, the baseline for the KvHint pair's. By default the
heap is frozen after the fill, so the index KvHint built during the fill is frozen with vLLM's
pool and no full collection traverses it. `--freeze-before-fill` freezes first, as EngineCore
freezes its start-up heap before it serves: the fill stands in for the serving history, and what
it builds (KvHint's index, the sessions' state) stays in the collector's generations, as it does
in an engine that has served for a while. That is the setting for the full (generation 2)
collections' frequency and cost.

Both sides live in one process, so a young collection that KvHint's allocations trigger also
traverses the young objects of the stock side: what lands on KvHint here is an upper bound of what
it would cost alone. Prints the table; with `--out`, writes it (markdown) and the raw figures
(json, same name).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from .report import write_results
from .scale_driver import Pair
from .scale_workload import Shape


CENSUS_STEPS = 100  # pass 3's steps at most (each settle lists the young generation)


def collections_pass(pair: Pair, steps: int) -> dict[str, Any]:
    running = {"region": "neither"}
    spent: dict[tuple[str, int], list[int]] = {}
    started = [0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter_ns()
        else:
            spent.setdefault((running["region"], info["generation"]), []).append(time.perf_counter_ns() - started[0])

    def around(region: str, call: Callable[[], Any]) -> Any:
        running["region"] = region
        try:
            return call()
        finally:
            running["region"] = "neither"

    pair.units.clear()
    gc.callbacks.append(on_gc)
    try:
        with pair.around_steps(around):
            pair.steps(steps, "steady")
    finally:
        gc.callbacks.remove(on_gc)
    units = pair.units
    stock = sum(u.stock_ns for u in units)
    kv = sum(u.kv_ns for u in units)
    return {
        "steps": len(units),
        "median_ratio": round(statistics.median(u.kv_ns / u.stock_ns for u in units), 3),
        "totals_ratio": round(kv / stock, 3),
        "kv_minus_stock_us_per_step": round((kv - stock) / len(units) / 1e3),
        "collections": [
            {"region": region, "generation": generation, "count": len(times),
             "ms_each": round(sum(times) / len(times) / 1e6, 2), "us_per_step": round(sum(times) / len(units) / 1e3)}
            for (region, generation), times in sorted(spent.items())
        ],
    }


def young_pass(pair: Pair, steps: int) -> dict[str, dict[str, float]]:
    deltas: dict[str, list[int]] = {}

    def around(region: str, call: Callable[[], Any]) -> Any:
        gc.disable()
        before = gc.get_count()[0]
        try:
            return call()
        finally:
            deltas.setdefault(region, []).append(gc.get_count()[0] - before)
            gc.enable()

    with pair.around_steps(around):
        pair.steps(steps, "steady")
    return {region: {"mean": round(statistics.mean(d), 1), "median": statistics.median(d), "max": max(d)}
            for region, d in sorted(deltas.items())}


def census_pass(pair: Pair, steps: int) -> dict[str, float]:
    """What the KvHint side's deferred settle leaves alive, by type, per settle: before each
    settle a young collection empties the young generation, and with the collector off for the
    settle, what the young generation then holds was made by the settle and is still referenced
    (tracked objects only: the collector's own view). These are what later collections
    traverse and promote, and, once they reach the oldest generation, what counts toward
    CPython's long-lived heuristic for full collections. The settle's own young collection is
    skipped here (it would move them out of view). Empty for a pair without deferred
    bookkeeping."""
    kv = pair.kv
    if kv.core is None or not kv.core.journal.deferring:
        return {}
    made: Counter[str] = Counter()
    journal = kv.core.journal

    def around(region: str, call: Callable[[], Any]) -> Any:
        if region != "settle":
            return call()
        gc.collect(0)
        gc.disable()
        collect, journal.collect_young = journal.collect_young, lambda: False  # type: ignore[method-assign]
        try:
            return call()
        finally:
            journal.collect_young = collect  # type: ignore[method-assign]
            made.update(f"{type(obj).__module__}.{type(obj).__qualname__}" for obj in gc.get_objects(0))
            gc.enable()

    with pair.around_steps(around):
        pair.steps(steps, "steady")
    return {name: round(n / steps, 1) for name, n in made.most_common()}


def markdown(raw: dict[str, Any]) -> str:
    c = raw["collections"]
    second = "stock-b" if raw.get("aa") else "KvHint"
    lines = [
        "# Where bench.scale's collections land",
        "",
        f"`{raw['command']}` on commit {raw['commit']}; {raw['shape']}.",
        "",
        f"Pass 1, {c['steps']} steps: {second} / stock scheduler CPU per step, median of per-step ratios "
        f"{c['median_ratio']:.3f}x, ratio of totals {c['totals_ratio']:.3f}x "
        f"({second} - stock: {c['kv_minus_stock_us_per_step']} us per step).",
        *([f"Collector thresholds while the steps ran: {tuple(raw['thresholds'])}."] if raw.get("thresholds") else []),
        "",
        "| during | generation | collections | ms each | us per step |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {r['region']} | {r['generation']} | {r['count']} | {r['ms_each']:.2f} | {r['us_per_step']} |"
              for r in c["collections"]]
    lines += [
        "",
        f"Pass 2, {raw['steps']} more steps with the collector off inside each region: change of the young "
        "generation's allocation count (`gc.get_count()[0]`) across the region (settle: the KvHint side's "
        "deferred bookkeeping, run by the driver between steps).",
        "",
        "| region | mean | median | max |",
        "|---|---|---|---|",
    ]
    lines += [f"| {region} | {d['mean']:+.1f} | {d['median']:+g} | {d['max']:+d} |" for region, d in raw["young"].items()]
    census = raw.get("census")
    if census:
        lines += [
            "",
            f"Pass 3, {raw['census_steps']} more steps: the tracked objects each deferred settle leaves alive, by type "
            "(the young generation emptied before the settle, the collector off during it; the settle's own young "
            "collection skipped), per settle:",
            "",
            "| type | per settle |",
            "|---|---|",
        ]
        lines += [f"| `{name}` | {n:.1f} |" for name, n in census.items()]
    lines += ["", "One run, single pair: a diagnostic, not a ratio to quote as the overhead (bench.scale is that).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scale_gc_probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pool", type=int, default=16384)
    ap.add_argument("--sessions", type=int, default=10000)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--bookkeeping", choices=("auto", "inline", "deferred"), default="auto",
                    help="KvHint's residency bookkeeping (deferred: settled between steps, outside the timing)")
    ap.add_argument("--no-settler-gc", action="store_true",
                    help="deferred: settle without the settler's young collection (ResidencyJournal.collect_young)")
    ap.add_argument("--aa", action="store_true", help="a stock/stock pair instead (the process without KvHint)")
    ap.add_argument("--freeze-before-fill", action="store_true",
                    help="freeze the heap before the fill, as EngineCore before it serves (default: after the fill)")
    ap.add_argument("--out", default=None, help="write the table here (markdown) and the raw figures next to it (.json)")
    a = ap.parse_args(argv)
    if a.aa and a.no_settler_gc:
        ap.error("--no-settler-gc changes KvHint's settler: a --aa pair has none")
    shape = Shape(a.pool, a.sessions, steps=a.steps, bookkeeping=a.bookkeeping)
    command = "python -m bench.scale_gc_probe" + "".join(
        f" --{k} {v}" for k, v, d in (("pool", a.pool, 16384), ("sessions", a.sessions, 10000), ("steps", a.steps, 150),
                                      ("bookkeeping", a.bookkeeping, "auto")) if v != d)
    command += "".join(f" --{flag}" for flag, on in (("no-settler-gc", a.no_settler_gc), ("aa", a.aa),
                                                    ("freeze-before-fill", a.freeze_before_fill)) if on)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    pair = Pair(shape, aa=a.aa)
    if a.no_settler_gc and pair.kv.core is not None:
        pair.kv.core.journal.collect_young = lambda: False  # type: ignore[method-assign]
    try:
        pair.fill_and_freeze(freeze_first=a.freeze_before_fill)
        pair.steps(shape.warmup_steps, "warmup")
        raw = {"command": command, "commit": commit or "unknown", "shape": shape.label, "steps": a.steps, "aa": a.aa,
               "thresholds": list(gc.get_threshold()),
               "collections": collections_pass(pair, a.steps), "young": young_pass(pair, a.steps)}
        raw["census_steps"] = min(a.steps, CENSUS_STEPS)
        raw["census"] = census_pass(pair, raw["census_steps"])
    finally:
        pair.close()
    write_results(a.out, raw, markdown(raw))
    return 0


if __name__ == "__main__":
    sys.exit(main())
