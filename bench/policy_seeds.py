"""Cold against warm, and the ranking rules, over more seeds than `bench.policy_report`.

    python -m bench.policy_seeds [--seeds 10]

`bench.policy_report` runs three seeds per preset; the per-trace share of Belady's savings moves
by 0.05-0.09 between cold and warm runs of the same trace, so three seeds cannot tell which is
better. This runs `--seeds` traces per preset (heldout from seed 1001, the others from 0; warm
trained on seed + 100 as in `bench.policy_report`) for a few `PolicyConfig` variants and prints,
per preset, the mean share cold / warm and the mean paired difference warm - cold with its
standard error. Nothing is written; docs/design-notes.md quotes its output.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace

from bench.generate import PRESETS, generate_trace
from bench.policy_report import FIRST_SEED, WARM_SEED_OFFSET
from bench.simulate import compile_trace, learned_pause_state, simulate_belady, simulate_library, simulate_lru

PRESET_NAMES = ("default", "heldout", "coding", "research")
VARIANTS: dict[str, dict[str, object]] = {
    "quantile 0.7 (default)": {},
    "index": {"ranking": "index"},
    "quantile 0.6": {"quantile": 0.6},
    "quantile 0.8": {"quantile": 0.8},
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.policy_seeds", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=10)
    a = ap.parse_args(argv)
    traces = []
    for preset in PRESET_NAMES:
        first = FIRST_SEED.get(preset, 0)
        for seed in range(first, first + a.seeds):
            bt = compile_trace(generate_trace(PRESETS[preset], seed, preset=preset))
            state = learned_pause_state(compile_trace(generate_trace(PRESETS[preset], seed + WARM_SEED_OFFSET, preset=preset)))
            traces.append((preset, bt, state, simulate_lru(bt).recomputed_tokens, simulate_belady(bt).recomputed_tokens))
    print(f"{a.seeds} seeds per preset; mean share of Belady's savings cold / warm, warm - cold (standard error)")
    for label, kw in VARIANTS.items():
        shares: dict[str, list[tuple[float, float]]] = {p: [] for p in PRESET_NAMES}
        for preset, bt, state, lru, bel in traces:
            cfg = replace(bt.library_config, **kw)
            cold, warm = (simulate_library(bt, cfg, pause_state=s).recomputed_tokens for s in (None, state))
            shares[preset].append(((lru - cold) / (lru - bel), (lru - warm) / (lru - bel)))
        cells = []
        for preset, rows in shares.items():
            diff = [w - c for c, w in rows]
            se = statistics.stdev(diff) / len(diff) ** 0.5 if len(diff) > 1 else float("nan")
            cells.append(f"{preset} {statistics.mean(c for c, _ in rows):.3f} / {statistics.mean(w for _, w in rows):.3f}"
                         f" ({statistics.mean(diff):+.3f} +- {se:.3f})")
        every = [x for rows in shares.values() for x in rows]
        print(f"{label}: " + "; ".join(cells)
              + f"; all {statistics.mean(c for c, _ in every):.3f} / {statistics.mean(w for _, w in every):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
