"""Simulator comparison of the hint policies over every preset and several seeds.

    python -m bench.policy_report [--out bench/results/policy] [--seeds 3]

For each generated trace it runs `bench.simulate.analyze` with the tier runs: (a) LRU, (b) the
earlier reference policy (with Release), (c) `kvhint_client.policy`, (d) Belady-MIN, (e) the
infinite cache, (f) a host tier as large as the device pool without hints, (g) the same tier
with `kvhint_client.policy` (and the reference policy's tier variant for comparison). It writes
``results.json`` (every simulator result) and ``results.md`` (the tables and the issue's goals,
checked on the committed default and heldout traces and on every preset and seed).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from bench.generate import PRESETS, generate_trace
from bench.simulate import Analysis, analyze

#: The committed traces the goals name (bench/results/*/trace.jsonl): preset -> seed.
COMMITTED = {"default": 0, "heldout": 1001}
FIRST_SEED = {"heldout": 1001}
GOAL_SHARE = 0.75  # device only: share of Belady's savings over LRU
GOAL_TIERS = 1.25  # host tier = device pool: recomputed / infinite cache


def run(seeds: int) -> list[dict[str, Any]]:
    rows = []
    for preset in ("default", "heldout", "coding", "research"):
        first = FIRST_SEED.get(preset, 0)
        for seed in range(first, first + seeds):
            t0 = time.perf_counter()
            a = analyze(generate_trace(PRESETS[preset], seed, preset=preset), tiers=True)
            rows.append(_row(preset, seed, a, time.perf_counter() - t0))
    return rows


def _row(preset: str, seed: int, a: Analysis, seconds: float) -> dict[str, Any]:
    lru = a.results["lru"].recomputed_tokens
    return {
        "preset": preset,
        "seed": seed,
        "committed": COMMITTED.get(preset) == seed,
        "num_gpu_blocks": a.num_gpu_blocks,
        "peak_live_blocks": a.peak_live_blocks,
        "share_of_belady": {n: round(a.share_of_belady(n), 4) for n in ("hints+release", "policy")},
        "x_lru": {n: round(r.recomputed_tokens / lru, 4) for n, r in a.results.items()},
        "x_infinite": {n: round(a.vs_infinite(n), 4) for n in a.results},
        "results": a.to_json()["results"],
        "seconds": round(seconds, 2),
    }


def markdown(rows: list[dict[str, Any]], command: str) -> str:
    out = [
        "# Hint policies in the simulator: every preset, several seeds",
        "",
        f"Command: `{command}`. Sequential simulator (`bench.simulate`), vLLM 0.32's block pool model; "
        "pool = the trace header's size; tier runs use a host tier as large as the device pool "
        "(`bench.simulate.HostTier`).",
        "",
        "Recomputed prompt tokens relative to LRU (lower is better), share of Belady's savings over LRU "
        "captured (device only), and recomputed tokens relative to the infinite cache for the tier runs.",
        "",
        "| trace | (b) reference + Release | (c) kvhint_client.policy | (d) Belady | (e) infinite "
        "| (b) share | (c) share | (f) tiers, no hints / inf | (g0) tiers, reference / inf | (g) tiers, policy / inf |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        x, inf, share = r["x_lru"], r["x_infinite"], r["share_of_belady"]
        name = f"{r['preset']} seed {r['seed']}" + (" (committed)" if r["committed"] else "")
        out.append(
            f"| {name} | {x['hints+release']:.3f} | {x['policy']:.3f} | {x['belady']:.3f} | {x['infinite']:.3f} "
            f"| {share['hints+release']:.2f} | {share['policy']:.2f} | {inf['tiers+none']:.2f} "
            f"| {inf['tiers+reference']:.2f} | {inf['tiers+library']:.2f} |"
        )
    out += ["", "## Goals", ""]
    for r in rows:
        if not r["committed"]:
            continue
        share, tiers = r["share_of_belady"]["policy"], r["x_infinite"]["tiers+library"]
        out.append(
            f"* {r['preset']} (committed trace): share of Belady's savings {share:.2f} "
            f"({'met' if share >= GOAL_SHARE else 'missed'}, goal >= {GOAL_SHARE}); with tiers {tiers:.2f} x infinite "
            f"({'met' if tiers <= GOAL_TIERS else 'missed'}, goal <= {GOAL_TIERS})."
        )
    worse = [f"{r['preset']} seed {r['seed']} ({r['x_lru']['policy']:.3f})" for r in rows if r["x_lru"]["policy"] > 1.0]
    out.append(
        "* (c) never recomputes more than LRU: "
        + ("met on every preset and seed." if not worse else "missed on " + ", ".join(worse) + ".")
    )
    means = {}
    for r in rows:
        means.setdefault(r["preset"], []).append(r["share_of_belady"]["policy"])
    out.append(
        "* Mean share of Belady's savings per preset: "
        + ", ".join(f"{p} {sum(v) / len(v):.2f}" for p, v in means.items())
        + f" (goal >= {GOAL_SHARE})."
    )
    out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.policy_report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/policy")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per preset (heldout starts at 1001, the others at 0)")
    a = ap.parse_args(argv)
    command = "python -m bench.policy_report" + ("" if a.seeds == 3 else f" --seeds {a.seeds}")
    rows = run(a.seeds)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"command": command, "rows": rows}, indent=1, default=_nan) + "\n")
    (out / "results.md").write_text(markdown(rows, command))
    print((out / "results.md").read_text())
    return 0


def _nan(o: Any) -> Any:
    return None if isinstance(o, float) and math.isnan(o) else str(o)


if __name__ == "__main__":
    raise SystemExit(main())
