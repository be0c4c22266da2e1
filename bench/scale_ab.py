"""Two versions of KvHint side by side on bench.scale's paired steps: did a change to the hooks
move the engine thread's cost?

    python -m bench.scale_ab --base REV [--shapes deferred async grants] [--rounds 3] [--steps 150]
                             [--out bench/results/scale_ab.md]

bench.scale measures one version against stock vLLM; a change worth a point or two is inside
its run-to-run spread (its A/A rows move by about 2 points between runs). Here each round runs
every shape once with the base revision (a `git worktree` of REV) and once with the working
tree, in alternating order, each in a fresh process with the same seed: a drift of the machine
reaches both versions, and the per-round difference of the two ratios is the figure to read.

Each run is one `scale_driver.Pair` (stock vs KvHint, both vLLM's real scheduler, no model) of
the shape, filled and warmed as in bench.scale, then `--steps` measured steady steps: the
median of per-step KvHint / stock CPU ratios and the ratio of totals (engine thread; deferred
bookkeeping is settled after each step outside the timed region, as bench.scale does). Shapes
(131072 blocks of 16 tokens, 10000 sessions, no hint during the measured steps):

  * deferred: the synchronous scheduler, deferred bookkeeping;
  * async: vLLM's AsyncScheduler, deferred bookkeeping (its default, `auto`);
  * grants: as async, with retention grants in effect (1000 hints/s during the warm-up, TTLs
    past the run): the retention order's own engine-thread work;
  * hybrid: as async, on a hybrid model's layout (full attention and a 128-token sliding window,
    two KV-cache groups sharing the pool).

The child process imports bench.scale_driver / bench.scale_workload of the tree it measures,
so REV must have them (commit 2b63181 or later).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .report import command_line, git, git_head, write_results

SHAPES: dict[str, dict[str, Any]] = {
    "deferred": {"bookkeeping": "deferred"},
    "async": {"async_scheduling": True},
    "grants": {"async_scheduling": True, "hints_per_step": 20, "hints_in_warmup_only": True, "hint_ttl_steps": 10_000},
    # bench.scale_target's: the settler thread with a device wait, and the stock-vs-stock null.
    "settler": {"async_scheduling": True, "settler_thread": True, "gpu_wait_s": 0.02},
    "aa": {"aa": True},
    # The async shape on a hybrid model's layout (two KV-cache groups share the pool).
    "hybrid": {"async_scheduling": True, "hybrid": True},
}
DEFAULT_SHAPES = ["deferred", "async", "grants"]
POOL, SESSIONS = 131072, 10000

# Run in the measured tree (PYTHONPATH and cwd): one pair, one JSON line on stdout.
CHILD = """
import json, statistics, sys
from bench.scale_driver import Pair
from bench.scale_workload import Shape
kw = json.loads(sys.argv[1])
aa = kw.pop("aa", False)
kv_first = kw.pop("kv_first", False)
shape = Shape(kw.pop("pool"), kw.pop("sessions"), **kw)
pair = Pair(shape, aa=aa, kv_first=kv_first)
try:
    pair.fill_and_freeze()
    pair.steps(shape.warmup_steps, "warmup")
    pair.units.clear()
    pair.steps(shape.steps, "steady")
    u = pair.units
    s, k = sum(x.stock_ns for x in u), sum(x.kv_ns for x in u)
    sw, kw_ = sum(x.stock_wall_ns for x in u), sum(x.kv_wall_ns for x in u)
    try:
        from bench.scale_driver import balanced_ratio
        median = balanced_ratio(u)
    except ImportError:  # a base revision from before the order-balanced statistic
        median = statistics.median(x.kv_ns / x.stock_ns for x in u)
    print(json.dumps({"median": median, "median_pooled": statistics.median(x.kv_ns / x.stock_ns for x in u),
                      "totals": k / s, "wall_totals": kw_ / sw if sw else None, "kv_first": kv_first,
                      "stock_ms": s / len(u) / 1e6, "extra_us": (k - s) / len(u) / 1e3, "steps": len(u)}))
finally:
    pair.close()
"""


def run_one(tree: Path, shape: str, steps: int, pool: int = POOL, sessions: int = SESSIONS,
            extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """One pair of `shape` measured in a fresh process on the code of `tree` (`extra`: more
    Shape fields, for small test runs)."""
    kw = {"pool": pool, "sessions": sessions, "steps": steps, **SHAPES[shape], **(extra or {})}
    env = {**os.environ, "PYTHONPATH": str(tree), "KVHINT_GRPC_ADDRESS": "127.0.0.1:0"}
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(kw)], cwd=tree, env=env, capture_output=True,
                         text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{shape} in {tree} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"{shape} in {tree} printed no result:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return json.loads(lines[-1])


def markdown(raw: dict[str, Any]) -> str:
    out = [
        "# Two versions of KvHint side by side (bench.scale's paired steps)",
        "",
        f"Command: `{raw['command']}`. Base: {raw['base']} ({raw['base_commit'][:7]}); head: the working tree of "
        f"{raw['head_commit'][:7]}{' (with uncommitted changes)' if raw['head_dirty'] else ''}. {POOL} blocks, "
        f"{SESSIONS} sessions, {raw['steps']} measured steps per run; each round runs every shape once per version, "
        "in alternating order, each run a fresh process and a fresh stock/KvHint pair (module doc of "
        "bench/scale_ab.py). Engine-thread CPU, KvHint / stock.",
        "",
        "| shape | base: median of per-step ratios (min - max) | head: median of per-step ratios (min - max) "
        "| base: ratio of totals | head: ratio of totals | head - base per round (median ratios) |",
        "|---|---|---|---|---|---|",
    ]
    for shape in raw["shapes"]:
        rows = [r for r in raw["rows"] if r["shape"] == shape]
        by = {v: [r for r in rows if r["version"] == v] for v in ("base", "head")}

        def span(version: str, key: str) -> str:
            vals = [r[key] for r in by[version]]
            return f"{statistics.median(vals):.3f}x ({min(vals):.3f}x - {max(vals):.3f}x)"

        diffs = []
        for rnd in sorted({r["round"] for r in rows}):
            pair = {r["version"]: r for r in rows if r["round"] == rnd}
            if len(pair) == 2:
                diffs.append(f"{(pair['head']['median'] - pair['base']['median']) * 100:+.1f}")
        out.append(f"| {shape} | {span('base', 'median')} | {span('head', 'median')} | {span('base', 'totals')} "
                   f"| {span('head', 'totals')} | {', '.join(diffs)} points |")
    out += ["", "Every run:", "", "| round | shape | version | median of per-step ratios | ratio of totals "
            "| stock ms per step | KvHint - stock us per step |", "|---|---|---|---|---|---|---|"]
    for r in raw["rows"]:
        out.append(f"| {r['round'] + 1} | {r['shape']} | {r['version']} | {r['median']:.3f}x | {r['totals']:.3f}x "
                   f"| {r['stock_ms']:.3f} | {r['extra_us']:.0f} |")
    out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scale_ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the git revision to compare the working tree with")
    ap.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, choices=list(SHAPES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--out", default="bench/results/scale_ab.md")
    a = ap.parse_args(argv)
    if a.rounds < 1 or a.steps < 1:
        ap.error("--rounds and --steps must be at least 1")
    root = Path(git("rev-parse", "--show-toplevel"))
    base_commit = git("rev-parse", "--verify", f"{a.base}^{{commit}}")
    head_commit, head_dirty = git_head()
    raw: dict[str, Any] = {
        "command": command_line("bench.scale_ab", argv), "base": a.base, "base_commit": base_commit, "head_commit": head_commit,
        "head_dirty": head_dirty, "steps": a.steps,
        "shapes": a.shapes, "rows": [],
    }
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvhint-scale-ab-") as tmp:
        base_tree = Path(tmp) / "base"
        git("worktree", "add", "--detach", str(base_tree), base_commit, cwd=root)
        try:
            trees = {"base": base_tree, "head": root}
            for rnd in range(a.rounds):
                for i, shape in enumerate(a.shapes):
                    order = ("base", "head") if (rnd + i) % 2 == 0 else ("head", "base")
                    for version in order:
                        row = {"round": rnd, "shape": shape, "version": version, **run_one(trees[version], shape, a.steps)}
                        raw["rows"].append(row)
                        print(f"[scale_ab] {row}", flush=True)
        finally:
            git("worktree", "remove", "--force", str(base_tree), cwd=root)
    raw["wall_s"] = round(time.monotonic() - t0, 1)
    write_results(a.out, raw, markdown(raw))
    return 0


if __name__ == "__main__":
    sys.exit(main())
