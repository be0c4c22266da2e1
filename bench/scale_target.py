"""Issue 12's target, "<= 1.03x scheduler CPU with 10k sessions and no hints changing", decided
over repeated fresh pairs instead of one run's rows.

    python -m bench.scale_target [--rounds 5] [--steps 150] [--out bench/results/scale_target.md]

One bench.scale run measures each shape once, in one process, and its report's verdict takes the
worst deferred row. On this 2-CPU machine a shape's median moves by 2 to 3 points between runs
(bench.scale's A/A row, and the rounds of bench/results/scale_ab.md), as much as the margin the
target leaves, so which row is worst is mostly which run drew the slow moment. Here each round
runs every shape once, in a shuffled order (seeded), each run a fresh process and a fresh stock /
KvHint pair of bench.scale's workload (`scale_ab.run_one` on this tree: fill, warm-up, then
`--steps` measured steps; engine-thread CPU, KvHint / stock, per step). Shapes (131072 blocks of
16 tokens, 10000 sessions, no hint during the measured steps):

  * aa: stock against stock, the null: how far from 1.000x a pair of identical sides lands;
  * deferred, async, settler: KvHint loaded and no hint ever sent, with the synchronous
    scheduler (deferred bookkeeping), vLLM's AsyncScheduler (the GPU default, `auto`), and the
    AsyncScheduler with the journal's real settler thread and a 20 ms device wait per step;
  * hybrid: as async, on a hybrid model's layout: two KV-cache groups, full attention and a
    128-token sliding window, share the pool (Gemma 2's; the same pool of blocks);
  * grants: retention grants in effect from hints in the warm-up, none changing. Reported, and
    kept out of the verdict: hints were sent, so this is the cost of what they ask for (the
    retention order's per-block work), not the cost of loading KvHint.

Two biases of the pair, found in review and balanced out here (earlier results files, before
bench/results/scale_target_balanced.md, have neither):

  * the side built second runs faster (the A/A pair's second side came out under 1.000x in 21 of
    30 committed runs): rounds alternate which side is built first (`Pair(kv_first=)`; odd rounds
    build KvHint first), and the default is an even number of rounds;
  * the order of a step's two halves moves its ratio by points, and the seeded order gives every
    run the same split: a run's figure is `scale_driver.balanced_ratio`, the geometric mean of
    the median per-step ratio with KvHint first and with KvHint second (the pooled median is
    kept in the JSON as `median_pooled`).

Verdict per no-hint shape: the median over rounds of the runs' balanced per-step ratios, met at
or under 1.03x. The table gives every run, so the spread the verdict summarizes is visible, and
the wall-time ratio of totals (the settler thread's GIL waits show only there).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from .report import command_line, git, git_head, machine, write_results
from .scale_ab import POOL, SESSIONS, run_one

TARGET = 1.03
NO_HINT = ("deferred", "async", "settler", "hybrid")
SHAPES = ("aa", *NO_HINT, "grants")
LABELS = {
    "aa": "A/A: stock vs stock (synchronous scheduler)",
    "deferred": "no hint, synchronous scheduler, deferred bookkeeping",
    "async": "no hint, async scheduling (the GPU default), deferred bookkeeping",
    "settler": "no hint, async scheduling, the settler thread, 20 ms device wait per step",
    "hybrid": "no hint, async scheduling, deferred bookkeeping, hybrid layout (full attention + sliding window)",
    "grants": "grants in effect from warm-up hints, none changing (async, deferred; not in the verdict)",
}


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per shape: the runs' medians, their median, spread and pooled ratio of totals; `met` when
    every no-hint shape's median of runs is at or under TARGET."""
    shapes: dict[str, dict[str, Any]] = {}
    for shape in SHAPES:
        runs = [r for r in rows if r["shape"] == shape]
        if not runs:
            continue
        medians = [r["median"] for r in runs]
        shapes[shape] = {
            "runs": len(runs),
            "median": statistics.median(medians),
            "min": min(medians),
            "max": max(medians),
            "at_or_under_target": sum(m <= TARGET for m in medians),
            "totals": statistics.median(r["totals"] for r in runs),
            "wall_totals": statistics.median(w) if (w := [r["wall_totals"] for r in runs if r.get("wall_totals")]) else None,
        }
    judged = [s for s in NO_HINT if s in shapes]
    met = bool(judged) and all(shapes[s]["median"] <= TARGET for s in judged)
    return {"shapes": shapes, "judged": judged, "met": met}


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}x"


def markdown(raw: dict[str, Any]) -> str:
    v = raw["verdict"]
    worst = max(v["judged"], key=lambda s: v["shapes"][s]["median"]) if v["judged"] else None
    out = [
        "# Scheduler CPU with KvHint loaded and no hint changing, over repeated fresh pairs",
        "",
        f"Command: `{raw['command']}`. Machine: {raw['machine']}; vLLM {raw['vllm']}; commit "
        f"{raw['commit'][:7]}{' (with uncommitted changes)' if raw['dirty'] else ''}. {POOL} blocks of 16 tokens, "
        f"{SESSIONS} sessions, bench.scale's workload; {raw['rounds']} rounds, each running every shape once in "
        f"a shuffled order, each run a fresh process and a fresh stock / KvHint pair, {raw['steps']} measured "
        "steps per run (module doc of bench/scale_target.py). Engine-thread CPU per step, KvHint / stock. "
        f"Wall time {raw['wall_s'] / 60:.1f} min.",
        "",
        f"**Target (<= {TARGET:.2f}x, median over rounds of each no-hint shape): "
        f"{'met' if v['met'] else 'missed'}.**"
        + (f" Highest no-hint shape: {worst}, {v['shapes'][worst]['median']:.3f}x." if worst else ""),
        "",
        "| shape | runs | median of the runs' medians of per-step ratios | min - max | runs at or under "
        f"{TARGET:.2f}x | median of the runs' ratios of totals | median of the runs' wall-time ratios of totals |",
        "|---|---|---|---|---|---|---|",
    ]
    for shape, s in v["shapes"].items():
        out.append(f"| {LABELS[shape]} | {s['runs']} | {s['median']:.3f}x | {s['min']:.3f}x - {s['max']:.3f}x "
                   f"| {s['at_or_under_target']} of {s['runs']} | {s['totals']:.3f}x | {_x(s.get('wall_totals'))} |")
    out += ["", "Every run, in the order run (built first: which side of the pair was constructed first):", "",
            "| round | shape | built first | balanced per-step ratio | pooled median | ratio of totals | wall ratio of totals "
            "| stock ms per step | KvHint - stock us per step |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in raw["rows"]:
        out.append(f"| {r['round'] + 1} | {r['shape']} | {'KvHint' if r.get('kv_first') else 'stock'} | {r['median']:.3f}x "
                   f"| {_x(r.get('median_pooled'))} | {r['totals']:.3f}x | {_x(r.get('wall_totals'))} | {r['stock_ms']:.3f} "
                   f"| {r['extra_us']:.0f} |")
    out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    import vllm

    ap = argparse.ArgumentParser(prog="python -m bench.scale_target", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6, help="default 6: each build order in half the rounds")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--seed", type=int, default=0, help="the run order's shuffle")
    ap.add_argument("--out", default="bench/results/scale_target.md")
    a = ap.parse_args(argv)
    if a.rounds < 1 or a.steps < 1:
        ap.error("--rounds and --steps must be at least 1")
    root = Path(git("rev-parse", "--show-toplevel"))
    commit, dirty = git_head()
    raw: dict[str, Any] = {
        "command": command_line("bench.scale_target", argv), "commit": commit, "dirty": dirty, "machine": machine(),
        "vllm": vllm.__version__, "rounds": a.rounds, "steps": a.steps, "seed": a.seed, "rows": [],
    }
    order = random.Random(a.seed)
    t0 = time.monotonic()
    for rnd in range(a.rounds):
        shapes = list(a.shapes)
        order.shuffle(shapes)
        for shape in shapes:
            row = {"round": rnd, "shape": shape, **run_one(root, shape, a.steps, extra={"kv_first": rnd % 2 == 1})}
            raw["rows"].append(row)
            print(f"[scale_target] {row}", flush=True)
    raw["wall_s"] = round(time.monotonic() - t0, 1)
    raw["verdict"] = verdict(raw["rows"])
    write_results(a.out, raw, markdown(raw))
    return 0


if __name__ == "__main__":
    sys.exit(main())
