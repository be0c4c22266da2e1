"""Where the engine thread's extra time goes: cProfile of both sides of one bench.scale pair,
function by function, KvHint minus stock (the functions that grew most, then those that shrank
most).

    python -m bench.scale_profile [--shape deferred|async|grants] [--steps 150] [--top 30]
                                  [--out bench/results/scale_profile_<shape>.md]

One `scale_driver.Pair` of the shape (bench.scale_ab's shapes: 131072 blocks, 10000 sessions),
filled and warmed as in bench.scale; then each side's steps run under its own cProfile (the
deferred settle, outside the steps, is not profiled). The table lists the functions whose own
time (tottime) grew most on the KvHint side, with their calls per step on each side. A
profiler inflates call-heavy code, so the times are for ranking, not for the overhead: the
ratio of the two sides' totals is printed next to bench.scale's unprofiled ratio for that.
Calls per step are exact.

    python -m bench.scale_profile --method entry-timers [--shape async] [--steps 300]
                                  [--out bench/results/scale_entry_timers_<shape>.md]

Without a profiler: the same pair, with the same timer wrapped around each vLLM method on both
sides that KvHint's hooks override or that vLLM's scheduler calls around them (ENTRY_POINTS:
the BlockPool's, the KVCacheManager's). Each side pays the same wrappers, so per method the
KvHint - stock difference is what KvHint adds inside that call, its callbacks included, without
cProfile's per-call inflation. The timers nest (allocate_slots contains cache_blocks, which
contains cache_full_blocks): a row's time includes the rows inside it. The wrappers are instance
attributes added after construction on both sides, so both sides' pools and managers lose
CPython's compact attribute storage alike (engine_integration/hooks.py's module doc), and the
totals, wrappers included, read higher than bench.scale's.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from pathlib import Path
from typing import Any

from .report import command_line
from .scale_ab import POOL, SESSIONS, SHAPES


def _key(func: tuple[str, int, str]) -> str:
    filename, line, name = func
    return f"{Path(filename).name}:{line}({name})" if line else name


def _shape(shape_name: str, steps: int, pool: int, sessions: int, extra: dict[str, Any] | None) -> Any:
    """bench.scale_ab's shape `shape_name` at this size (`extra`: more Shape fields)."""
    from .scale_workload import Shape

    return Shape(pool, sessions, steps=steps, **{**SHAPES[shape_name], **(extra or {})})


def profile(shape_name: str, steps: int, pool: int = POOL, sessions: int = SESSIONS,
            extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Profile one pair of `shape_name` (`extra`: more Shape fields, for small test runs)."""
    from .scale_driver import Pair

    shape = _shape(shape_name, steps, pool, sessions, extra)
    pair = Pair(shape)
    profs = {"stock": cProfile.Profile(), "kvhint": cProfile.Profile()}

    def around(region: str, call: Any) -> Any:
        if region == "settle":
            return call()
        prof = profs[region]
        prof.enable()
        try:
            return call()
        finally:
            prof.disable()

    try:
        pair.fill_and_freeze()
        pair.steps(shape.warmup_steps, "warmup")
        with pair.around_steps(around):
            pair.steps(steps, "steady")
    finally:
        pair.close()
    stats = {side: {_key(f): (v[1], v[2]) for f, v in pstats.Stats(p).stats.items()}  # type: ignore[attr-defined]
             for side, p in profs.items()}
    totals = {side: sum(t for _, t in s.values()) for side, s in stats.items()}
    rows = []
    for name in set(stats["stock"]) | set(stats["kvhint"]):
        sc, st = stats["stock"].get(name, (0, 0.0))
        kc, kt = stats["kvhint"].get(name, (0, 0.0))
        rows.append({"function": name, "stock_calls": sc, "kvhint_calls": kc, "stock_s": st, "kvhint_s": kt})
    rows.sort(key=lambda r: r["kvhint_s"] - r["stock_s"], reverse=True)
    return {"shape": shape_name, "label": shape.label, "steps": steps, "totals": totals, "rows": rows}


# (owner, method): the vLLM entry points timed on both sides (module doc); "pool" is the
# KVCacheManager's BlockPool, "manager" the KVCacheManager. Outer ones first.
ENTRY_POINTS: tuple[tuple[str, str], ...] = (
    ("manager", "get_computed_blocks"),
    ("manager", "allocate_slots"),
    ("manager", "cache_blocks"),
    ("manager", "free"),
    ("manager", "record_prefix_cache_stats"),
    ("pool", "cache_full_blocks"),
    ("pool", "get_new_blocks"),
    ("pool", "free_blocks"),
    ("pool", "touch"),
    ("pool", "get_num_free_blocks"),
)


def entry_timers(shape_name: str, steps: int, pool: int = POOL, sessions: int = SESSIONS,
                 extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Time ENTRY_POINTS on both sides of one pair of `shape_name` (`extra`: more Shape fields,
    for small test runs): per side and method, calls and nanoseconds over `steps` steady steps."""
    from time import perf_counter_ns

    from .scale_driver import Pair

    shape = _shape(shape_name, steps, pool, sessions, extra)
    pair = Pair(shape)
    calls: dict[str, dict[str, int]] = {"stock": {}, "kvhint": {}}
    spent: dict[str, dict[str, int]] = {"stock": {}, "kvhint": {}}

    def timed(side: str, obj: Any, name: str) -> None:
        method, n, ns = getattr(obj, name), calls[side], spent[side]
        n[name] = ns[name] = 0

        def call(*a: Any, **k: Any) -> Any:
            t = perf_counter_ns()
            try:
                return method(*a, **k)
            finally:
                ns[name] += perf_counter_ns() - t
                n[name] += 1

        setattr(obj, name, call)

    try:
        pair.fill_and_freeze()
        pair.steps(shape.warmup_steps, "warmup")
        for side, s in (("stock", pair.stock), ("kvhint", pair.kv)):
            manager = s.sched.kv_cache_manager
            owners = {"manager": manager, "pool": manager.block_pool}
            for owner, name in ENTRY_POINTS:
                timed(side, owners[owner], name)
        pair.units.clear()
        pair.steps(steps, "steady")
        units = pair.units
        totals = {"stock": sum(u.stock_ns for u in units), "kvhint": sum(u.kv_ns for u in units)}
    finally:
        pair.close()
    rows = [{"owner": owner, "method": name, "stock_calls": calls["stock"][name], "kvhint_calls": calls["kvhint"][name],
             "stock_ns": spent["stock"][name], "kvhint_ns": spent["kvhint"][name]} for owner, name in ENTRY_POINTS]
    return {"shape": shape_name, "label": shape.label, "steps": steps, "totals_ns": totals, "rows": rows}


def entry_markdown(result: dict[str, Any], command: str) -> str:
    steps, totals = result["steps"], result["totals_ns"]
    per = steps * 1e3  # ns over the run -> us per step
    out = [
        f"# Where the engine thread's extra time goes, by vLLM entry point: {result['label']}",
        "",
        f"Command: `{command}`. The same timer around each entry point on both sides of one pair, over {steps} steady "
        "steps (module doc of bench/scale_profile.py, `--method entry-timers`): per method, the KvHint side's time "
        "minus the stock side's is what KvHint adds inside that call. Rows nest (allocate_slots contains "
        "cache_blocks, which contains cache_full_blocks). Engine-thread totals with the timers on: stock "
        f"{totals['stock'] / per:.1f} us per step, KvHint {totals['kvhint'] / per:.1f} "
        f"({totals['kvhint'] / totals['stock']:.3f}x, +{(totals['kvhint'] - totals['stock']) / per:.1f} us per step; "
        "bench.scale_target gives the untimed ratio).",
        "",
        "| entry point | calls per step, stock | calls per step, KvHint | us per step, stock | us per step, KvHint "
        "| KvHint - stock us per step |",
        "|---|---|---|---|---|---|",
    ]
    cls = {"manager": "KVCacheManager", "pool": "BlockPool"}
    for r in result["rows"]:
        out.append(f"| `{cls[r['owner']]}.{r['method']}` | {r['stock_calls'] / steps:.1f} | {r['kvhint_calls'] / steps:.1f} "
                   f"| {r['stock_ns'] / per:.1f} | {r['kvhint_ns'] / per:.1f} | {(r['kvhint_ns'] - r['stock_ns']) / per:+.1f} |")
    out.append("")
    return "\n".join(out)


def markdown(result: dict[str, Any], command: str, top: int) -> str:
    steps, totals = result["steps"], result["totals"]
    out = [
        f"# Where the engine thread's extra time goes: {result['label']}",
        "",
        f"Command: `{command}`. cProfile of each side's {steps} steady steps (module doc of bench/scale_profile.py); "
        f"profiled totals: stock {totals['stock']:.3f} s, KvHint {totals['kvhint']:.3f} s "
        f"({totals['kvhint'] / totals['stock']:.3f}x under the profiler, which inflates call-heavy code: "
        "bench.scale gives the unprofiled ratio). The functions whose own time grew most on the KvHint side:",
        "",
        "| function | calls per step, stock | calls per step, KvHint | own ms, stock | own ms, KvHint | KvHint - stock ms |",
        "|---|---|---|---|---|---|",
    ]
    header = out[-2:]

    def row(r: dict[str, Any]) -> str:
        return (f"| `{r['function']}` | {r['stock_calls'] / steps:.1f} | {r['kvhint_calls'] / steps:.1f} "
                f"| {r['stock_s'] * 1e3:.1f} | {r['kvhint_s'] * 1e3:.1f} | {(r['kvhint_s'] - r['stock_s']) * 1e3:+.1f} |")

    out += [row(r) for r in result["rows"][:top]]
    shrank = [r for r in reversed(result["rows"]) if r["kvhint_s"] < r["stock_s"]][:max(1, top // 3)]
    out += ["", "The functions whose own time shrank most on the KvHint side (vLLM methods the hooks run in "
            "their own code, and time swapped between wrappers):", "", *header, *(row(r) for r in shrank)]
    out += ["", "Wrappers of the timed region (the driver's `call`, KvHintScheduler's `update_from_output`) can swap "
            "time between them: what CPython frees or collects at a return is charged to the frame returning.", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scale_profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="deferred", choices=list(SHAPES))
    ap.add_argument("--method", default="cprofile", choices=("cprofile", "entry-timers"))
    ap.add_argument("--steps", type=int, default=None, help="default: 150 (cprofile), 300 (entry-timers)")
    ap.add_argument("--top", type=int, default=30, help="cprofile: the rows of each table")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    command = command_line("bench.scale_profile", argv)
    if a.method == "entry-timers":
        out = Path(a.out or f"bench/results/scale_entry_timers_{a.shape}.md")
        text = entry_markdown(entry_timers(a.shape, a.steps or 300), command)
    else:
        out = Path(a.out or f"bench/results/scale_profile_{a.shape}.md")
        text = markdown(profile(a.shape, a.steps or 150), command, a.top)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
