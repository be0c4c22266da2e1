"""The session policy on trace shapes that are not the presets: random `TraceParams`.

    python -m bench.policy_shapes [--shapes 100] [--seed 1]   # writes bench/results/policy/shapes.{md,json}
    python -m bench.policy_shapes --report-only               # shapes.md again from shapes.json

`bench.policy_report` and `bench.policy_seeds` measure the policy on the committed presets, the
shapes it was tuned on. A router replays its own agentic traffic, whose shape is none of them.
This draws `--shapes` trace shapes at random (from `--seed`): a preset as the base, then the
session count, concurrency, pool size against the peak live set, the pause-length ranges, the
share of long pauses, how often the declared duration class is wrong, fan-out and the shared
prefix, each from a wide range. It generates one trace per shape and simulates LRU, Belady and
`kvhint_client.policy` (cold) under a few `PolicyConfig` variants, in the sequential simulator
(`bench.simulate`). The table (generated from shapes.json) gives, per variant, the mean share of
Belady's savings over LRU and how often, and by how much at worst, the policy recomputed more
than LRU: issue 13's "hints never recompute more than LRU" on traces it was not tuned on.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench.generate import PRESETS, TraceParams, generate_trace
from bench.report import command_line
from bench.simulate import compile_trace, simulate_belady, simulate_library, simulate_lru

OUT = "bench/results/policy/shapes"

VARIANTS: dict[str, dict[str, object]] = {
    "quantile 0.7 (default)": {},
    "index": {"ranking": "index"},
    "quantile 0.5": {"quantile": 0.5},
}

#: The fields a shape draws (the rest are the base preset's); shapes.json keeps each draw.
DRAWN = ("num_sessions", "concurrency", "cache_fraction", "p_long", "mispredict_prob", "short_pause_s", "long_pause_s",
         "fanout_prob", "shared_prefix_tokens")


def draw_shape(rng: random.Random) -> tuple[str, TraceParams]:
    """A base preset's name and the parameters drawn on top of it."""
    base = rng.choice(sorted(PRESETS))
    short_lo, long_lo = rng.uniform(0.1, 3.0), rng.uniform(3.0, 30.0)
    return base, replace(
        PRESETS[base],
        num_sessions=rng.choice([8, 16, 32, 48]),
        concurrency=rng.choice([2, 4, 8, 16]),
        cache_fraction=rng.choice([0.25, 0.4, 0.5, 0.7, 0.9]),
        p_long=rng.uniform(0.05, 0.8),
        mispredict_prob=rng.uniform(0.0, 0.5),
        short_pause_s=(short_lo, short_lo * rng.uniform(1.5, 6.0)),
        long_pause_s=(long_lo, long_lo * rng.uniform(1.5, 8.0)),
        fanout_prob=rng.uniform(0.0, 0.5),
        shared_prefix_tokens=rng.choice([0, 128, 512, 1024]),
    )


def measure(shapes: int, seed: int, variants: dict[str, dict[str, object]] | None = None) -> list[dict[str, Any]]:
    """One row per shape: the draw, the trace seed, and recomputed prompt tokens per run."""
    variants = VARIANTS if variants is None else variants
    rng = random.Random(seed)
    rows = []
    for i in range(shapes):
        base, params = draw_shape(rng)
        trace_seed = rng.randrange(10**6)
        trace = generate_trace(params, trace_seed, preset=f"shape-{i}")
        bt = compile_trace(trace)
        lru = simulate_lru(bt)
        runs = {label: simulate_library(bt, replace(bt.library_config, **kw)) for label, kw in variants.items()}
        row: dict[str, Any] = {
            "shape": i, "base": base, "trace_seed": trace_seed,
            "params": {k: v for k, v in asdict(params).items() if k in DRAWN},
            "requests": len(bt.requests), "pool_blocks": bt.num_gpu_blocks,
            "lru": lru.recomputed_tokens, "belady": simulate_belady(bt).recomputed_tokens,
            "variants": {label: run.recomputed_tokens for label, run in runs.items()},
        }
        worse = {label: run for label, run in runs.items() if run.recomputed_tokens > lru.recomputed_tokens}
        if worse:
            kinds = _resume_kinds(trace)
            row["cached_vs_lru_by_resume"] = {
                label: _by_kind(kinds, bt, run.cached_tokens, lru.cached_tokens) for label, run in worse.items()}
        rows.append(row)
    return rows


def _resume_kinds(trace: Any) -> dict[str, str]:
    """Request id -> what it resumes after: "declared D, was C" for a tool call declared in class
    D whose true pause was class C; otherwise the request's cause (start, spawn, children)."""
    declared: dict[str, str | None] = {}
    kinds: dict[str, str] = {}
    for event in trace.events:
        e = event.to_json()
        if e["kind"] == "tool_call_started":
            declared[e["session_id"]] = e.get("expected_duration_class")
        elif e["kind"] == "request":
            cls = declared.pop(e["session_id"], None)
            kinds[e["request_id"]] = f"declared {cls}, was {e.get('cause')}" if cls else str(e.get("cause"))
    return kinds


def _by_kind(kinds: dict[str, str], bt: Any, cached: list[int], lru_cached: list[int]) -> dict[str, int]:
    """Cached prompt tokens minus LRU's, summed per resume kind (negative: the policy lost there)."""
    out: dict[str, int] = {}
    for request, mine, theirs in zip(bt.requests, cached, lru_cached):
        kind = kinds.get(request.request_id, "other")
        out[kind] = out.get(kind, 0) + mine - theirs
    return dict(sorted(out.items()))


def _share(row: dict[str, Any], recomputed: int) -> float | None:
    """Share of Belady's savings over LRU (None where Belady saves nothing)."""
    saved = row["lru"] - row["belady"]
    return (row["lru"] - recomputed) / saved if saved > 0 else None


def markdown(raw: dict[str, Any]) -> str:
    rows = raw["rows"]
    lines = [
        "# Session policy on random trace shapes (not the presets)",
        "",
        f"Command: `{raw['command']}`  ",
        f"{len(rows)} shapes drawn from seed {raw['seed']} (`bench.policy_shapes.draw_shape`), one trace each; cold pause "
        "model; sequential simulator (`bench.simulate`). Share: of Belady's savings over LRU, mean over the shapes where "
        "Belady saves anything.",
        "",
        "| variant | mean share | traces recomputing more than LRU | worst recomputed / LRU |",
        "|---|---|---|---|",
    ]
    for label in raw["variants"]:
        shares = [s for r in rows if (s := _share(r, r["variants"][label])) is not None]
        ratios = [r["variants"][label] / r["lru"] for r in rows if r["lru"]]
        over = sum(r["variants"][label] > r["lru"] for r in rows)
        lines.append(f"| {label} | {statistics.mean(shares):.3f} | {over} of {len(rows)} | {max(ratios):.3f}x |")
    worse = [r for r in rows if any(v > r["lru"] for v in r["variants"].values())]
    lines += ["", "Shapes where a variant recomputed more than LRU (recomputed / LRU per variant):", ""]
    if not worse:
        lines.append("none")
    for r in worse:
        p = r["params"]
        cells = ", ".join(f"{label} {v / r['lru']:.3f}x" for label, v in r["variants"].items())
        lines.append(
            f"* shape {r['shape']} (base {r['base']}, trace seed {r['trace_seed']}): {p['num_sessions']} sessions, "
            f"concurrency {p['concurrency']}, pool {r['pool_blocks']} blocks (cache fraction {p['cache_fraction']}), "
            f"long pauses {p['p_long']:.2f}, declared class wrong {p['mispredict_prob']:.2f}: {cells}; "
            f"Belady {r['belady'] / r['lru']:.3f}x."
        )
        for label, kinds in r.get("cached_vs_lru_by_resume", {}).items():
            lines.append(f"  * {label}, cached prompt tokens against LRU's by what the request resumed after: "
                         + ", ".join(f"{kind} {delta:+d}" for kind, delta in kinds.items()) + ".")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.policy_shapes", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=OUT, help="output path without suffix (.md and .json are written)")
    ap.add_argument("--report-only", action="store_true", help="regenerate the .md from the .json")
    a = ap.parse_args(argv)
    if a.shapes < 1:
        ap.error("--shapes must be at least 1")
    out = Path(a.out)
    if a.report_only:
        raw = json.loads(out.with_suffix(".json").read_text())
    else:
        raw = {"command": command_line("bench.policy_shapes", argv), "seed": a.seed, "variants": list(VARIANTS),
               "rows": measure(a.shapes, a.seed)}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(raw, indent=1) + "\n")
    text = markdown(raw)
    out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
