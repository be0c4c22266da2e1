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


def profile(shape_name: str, steps: int, pool: int = POOL, sessions: int = SESSIONS,
            extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Profile one pair of `shape_name` (`extra`: more Shape fields, for small test runs)."""
    from .scale_driver import Pair
    from .scale_workload import Shape

    shape = Shape(pool, sessions, steps=steps, **{**SHAPES[shape_name], **(extra or {})})
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
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    out = Path(a.out or f"bench/results/scale_profile_{a.shape}.md")
    result = profile(a.shape, a.steps)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown(result, command_line("bench.scale_profile", argv), a.top))
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
