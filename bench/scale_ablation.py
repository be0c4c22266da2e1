"""Where KvHint's no-hints scheduler cost goes: `bench.scale`'s paired steps with one piece of
KvHint's bookkeeping replaced by a no-op at a time.

    python -m bench.scale_ablation [--pool 16384] [--sessions 10000] [--steps 150] [--out bench/results/scale_ablation.md]

A diagnostic, not a configuration anyone runs: a no-op'd callback leaves the index and the event
stream wrong (e.g. without removals the index only grows). Each variant is a fresh stock/KvHint
pair (`scale_driver.Pair`) filled and warmed as in bench.scale, then the piece is replaced and
the steady steps are measured. Variants:

  * full: KvHint as shipped;
  * no collector: the same with Python's cyclic garbage collector disabled during the steps;
  * no event publishing: `EventBus.publish` does nothing (events are still built);
  * no index on admission: `KvHintCore.on_stored` does nothing;
  * no index on removal: `KvHintCore.on_removed` does nothing;
  * hooks only: the adapter's residency callbacks (`on_blocks_cached`, `on_keys_removed`,
    `on_prefix_hit`) do nothing, so what is left is the hooked vLLM methods themselves.

The difference between two variants is what the removed piece cost, within the run-to-run noise
of `bench.scale` (single figures move by about +-5%).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .scale_driver import Pair
from .scale_workload import Shape


def _noop(*_a: Any, **_k: Any) -> None:
    return None


def _publish(pair: Pair) -> None:
    pair.kv.core.bus.publish = _noop


def _stored(pair: Pair) -> None:
    pair.kv.core.on_stored = _noop


def _removed(pair: Pair) -> None:
    pair.kv.core.on_removed = _noop


def _callbacks(pair: Pair) -> None:
    adapter = pair.kv.sched.kvhint_adapter
    adapter.on_blocks_cached = _noop
    adapter.on_keys_removed = _noop
    adapter.on_prefix_hit = _noop


# name -> (what it changes, collector on)
VARIANTS: dict[str, tuple[Callable[[Pair], None] | None, bool]] = {
    "full": (None, True),
    "no collector": (None, False),
    "no event publishing": (_publish, True),
    "no index on admission": (_stored, True),
    "no index on removal": (_removed, True),
    "hooks only": (_callbacks, True),
}


def measure(shape: Shape, name: str) -> dict[str, Any]:
    change, collector = VARIANTS[name]
    pair = Pair(shape)
    try:
        pair.fill_and_freeze()
        if change is not None:
            change(pair)
        pair.steps(shape.warmup_steps, "warmup")
        pair.units.clear()
        if not collector:
            gc.disable()
        try:
            pair.steps(shape.steps, "steady")
        finally:
            gc.enable()
        units = pair.units
        stock = sum(u.stock_ns for u in units)
        kv = sum(u.kv_ns for u in units)
        return {
            "variant": name,
            "steps": len(units),
            "median_ratio": round(statistics.median(u.kv_ns / u.stock_ns for u in units), 4),
            "ratio_of_totals": round(kv / stock, 4),
            "stock_ms_per_step": round(stock / len(units) / 1e6, 3),
            "extra_us_per_step": round((kv - stock) / len(units) / 1e3, 1),
        }
    finally:
        pair.close()


def markdown(raw: dict[str, Any]) -> str:
    rows = raw["rows"]
    full = next((r for r in rows if r["variant"] == "full"), None)
    out = [
        "# Where the no-hints scheduler cost goes (bench.scale's paired steps, one piece removed at a time)",
        "",
        f"Command: `{raw['command']}`. {raw['shape']}; {rows[0]['steps']} measured steps per variant, each a fresh "
        "stock/KvHint pair. A no-op'd piece leaves KvHint's state wrong: this is a diagnostic (see the module doc "
        "of bench/scale_ablation.py).",
        "",
        "| variant | median of per-step ratios | ratio of totals | stock ms per step | KvHint - stock us per step "
        "| us per step against full |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        against = "-" if full is None or r is full else f"{r['extra_us_per_step'] - full['extra_us_per_step']:+.0f}"
        out.append(
            f"| {r['variant']} | {r['median_ratio']:.3f}x | {r['ratio_of_totals']:.3f}x | {r['stock_ms_per_step']:.3f} "
            f"| {r['extra_us_per_step']:.0f} | {against} |"
        )
    out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scale_ablation", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pool", type=int, default=16384)
    ap.add_argument("--sessions", type=int, default=10000)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--out", default="bench/results/scale_ablation.md")
    a = ap.parse_args(argv)
    shape = Shape(a.pool, a.sessions, steps=a.steps)
    command = "python -m bench.scale_ablation" + "".join(
        f" --{k} {v}" for k, v, d in (("pool", a.pool, 16384), ("sessions", a.sessions, 10000), ("steps", a.steps, 150)) if v != d
    ) + ("" if a.out == "bench/results/scale_ablation.md" else f" --out {a.out}")
    raw: dict[str, Any] = {"command": command, "shape": shape.label, "rows": []}
    t0 = time.monotonic()
    for name in a.variants:
        raw["rows"].append(measure(shape, name))
        print(f"[scale_ablation] {name}: {raw['rows'][-1]}", flush=True)
    raw["wall_s"] = round(time.monotonic() - t0, 1)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(raw, indent=1) + "\n")
    out.write_text(markdown(raw))
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
