"""Cold against warm, and the ranking rules, over more seeds than `bench.policy_report`.

    python -m bench.policy_seeds [--seeds 10]   # writes bench/results/policy/seeds.{md,json}
    python -m bench.policy_seeds --report-only  # seeds.md again from seeds.json

`bench.policy_report` runs three seeds per preset; the per-trace share of Belady's savings moves
by 0.05-0.09 between cold and warm runs of the same trace, so three seeds cannot tell which is
better. This runs `--seeds` traces per preset (heldout from seed 1001, the others from 0; warm
trained on seed + 100 as in `bench.policy_report`) for a few `PolicyConfig` variants and prints,
per preset, the mean share cold / warm and the mean paired difference warm - cold with its
standard error, into bench/results/policy/seeds.md (tables generated from seeds.json);
docs/design-notes.md quotes it.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.generate import PRESETS, generate_trace, oracle_pause_state
from bench.policy_report import FIRST_SEED, PRESET_NAMES, WARM_SEED_OFFSET
from bench.report import command_line
from bench.simulate import compile_trace, learned_pause_state, simulate_belady, simulate_library, simulate_lru

OUT = "bench/results/policy/seeds"

VARIANTS: dict[str, dict[str, object]] = {
    "quantile 0.7 (default)": {},
    "index": {"ranking": "index"},
    "quantile 0.6": {"quantile": 0.6},
    "quantile 0.65": {"quantile": 0.65},
    "quantile 0.75": {"quantile": 0.75},
    "quantile 0.8": {"quantile": 0.8},
    "prior weight 1": {"prior_weight": 1.0},
    "prior weight 4": {"prior_weight": 4.0},
    "index, prior weight 4": {"ranking": "index", "prior_weight": 4.0},
}

#: The same policy started from the generator's own pause distribution (bench.generate.oracle_pause_state).
ORACLE_VARIANTS: dict[str, dict[str, object]] = {
    "oracle distribution, quantile 0.7": {},
    "oracle distribution, index": {"ranking": "index"},
}


def _share(r: dict[str, Any], run: str) -> float:
    return (r["lru"] - r[run]) / (r["lru"] - r["belady"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.policy_seeds", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--report-only", action="store_true", help="regenerate seeds.md from seeds.json")
    a = ap.parse_args(argv)
    if a.report_only:
        text = markdown(json.loads(Path(OUT + ".json").read_text()))
        Path(OUT + ".md").write_text(text)
        print(text)
        return 0
    traces = []
    for preset in PRESET_NAMES:
        first = FIRST_SEED.get(preset, 0)
        for seed in range(first, first + a.seeds):
            bt = compile_trace(generate_trace(PRESETS[preset], seed, preset=preset))
            state = learned_pause_state(compile_trace(generate_trace(PRESETS[preset], seed + WARM_SEED_OFFSET, preset=preset)))
            traces.append((preset, seed, bt, state, simulate_lru(bt).recomputed_tokens, simulate_belady(bt).recomputed_tokens))
    rows: list[dict[str, Any]] = []
    for label, kw in VARIANTS.items():
        for preset, seed, bt, state, lru, bel in traces:
            cfg = replace(bt.library_config, **kw)
            cold, warm = (simulate_library(bt, cfg, pause_state=s).recomputed_tokens for s in (None, state))
            rows.append({"variant": label, "preset": preset, "seed": seed, "lru": lru, "belady": bel,
                         "cold": cold, "warm": warm})
    for preset, seed, bt, _, lru, bel in traces:  # the prediction ceiling (not causal)
        for label, kw in ORACLE_VARIANTS.items():
            cfg = replace(bt.library_config, **kw)
            oracle = simulate_library(bt, cfg, pause_state=oracle_pause_state(PRESETS[preset], seed=seed)).recomputed_tokens
            rows.append({"variant": label, "preset": preset, "seed": seed, "lru": lru, "belady": bel, "oracle": oracle})
    raw = {"command": command_line("bench.policy_seeds", argv), "seeds": a.seeds, "variants": VARIANTS,
           "oracle_variants": ORACLE_VARIANTS, "rows": rows}
    Path(OUT).parent.mkdir(parents=True, exist_ok=True)
    Path(OUT + ".json").write_text(json.dumps(raw, indent=1) + "\n")
    text = markdown(raw)
    Path(OUT + ".md").write_text(text)
    print(text)
    return 0


def markdown(raw: dict[str, Any]) -> str:
    """seeds.md from seeds.json: per variant and preset, mean share of Belady's savings over LRU,
    cold / warm, and the paired warm - cold with its standard error."""
    lines = [
        "# Session policy over more seeds: cold against warm, and the ranking choices",
        "",
        f"Command: `{raw['command']}`  ",
        f"{raw['seeds']} seeds per preset (heldout from 1001, the others from 0); warm: the pause model trained on seed + "
        f"{WARM_SEED_OFFSET} of the same preset. Cells: mean share of Belady's savings over LRU, cold / warm, then the mean "
        "paired difference warm - cold (+- its standard error). Sequential simulator (`bench.simulate`).",
        "",
        "| variant | " + " | ".join(PRESET_NAMES) + " | all presets, cold / warm |",
        "|---|" + "---|" * (len(PRESET_NAMES) + 1),
    ]
    for label in raw["variants"]:
        cells, every = [], []
        for preset in PRESET_NAMES:
            pairs = [(_share(r, "cold"), _share(r, "warm")) for r in raw["rows"] if r["variant"] == label and r["preset"] == preset]
            every += pairs
            diff = [w - c for c, w in pairs]
            se = statistics.stdev(diff) / len(diff) ** 0.5 if len(diff) > 1 else float("nan")
            cells.append(f"{statistics.mean(c for c, _ in pairs):.3f} / {statistics.mean(w for _, w in pairs):.3f} "
                         f"({statistics.mean(diff):+.3f} +- {se:.3f})")
        lines.append(f"| {label} | " + " | ".join(cells)
                     + f" | {statistics.mean(c for c, _ in every):.3f} / {statistics.mean(w for _, w in every):.3f} |")
    default = [r for r in raw["rows"] if r["variant"] == "quantile 0.7 (default)"]
    if default:
        lines += ["", "Never more than LRU (issue 13's goal, on every trace here), the default setting:"]
        for run in ("cold", "warm"):
            worst = max(default, key=lambda r: r[run] / r["lru"])
            over = sum(r[run] > r["lru"] for r in default)
            lines.append(
                f"* {run}: recomputed tokens at most {worst[run] / worst['lru']:.3f}x LRU's ({worst['preset']} seed "
                f"{worst['seed']}), more than LRU on {over} of {len(default)} traces: {'met' if not over else 'missed'}."
            )
    lines += [
        "",
        "Prediction ceiling, not causal: the policy started from the generator's own pause distribution "
        "(`bench.generate.oracle_pause_state`: 256 draws per key it learns under, mispredicted classes included), then "
        "learning as usual. Mean share of Belady's savings (cold, from the table above, in brackets):",
        "",
        "| variant | " + " | ".join(PRESET_NAMES) + " | all presets |",
        "|---|" + "---|" * (len(PRESET_NAMES) + 1),
    ]
    cold_of = {"oracle distribution, quantile 0.7": "quantile 0.7 (default)", "oracle distribution, index": "index"}
    for label in raw.get("oracle_variants", {}):
        cells, every, every_cold = [], [], []
        for preset in PRESET_NAMES:
            shares = [_share(r, "oracle") for r in raw["rows"] if r["variant"] == label and r["preset"] == preset]
            colds = [_share(r, "cold") for r in raw["rows"] if r["variant"] == cold_of[label] and r["preset"] == preset]
            every += shares
            every_cold += colds
            cells.append(f"{statistics.mean(shares):.3f} ({statistics.mean(colds):.3f})")
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {statistics.mean(every):.3f} ({statistics.mean(every_cold):.3f}) |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
