"""What a served test engine's dtype costs on this machine: vLLM's default against `--dtype float32`.

The generated presets are written in float32, and vLLM's default (`--dtype auto`) serves them in
bfloat16. On a CPU without bfloat16 instructions (AVX2 only: this project's CI machines) bfloat16
matrix products are emulated, and a prefill is several times slower than in float32. The test
suite's time is mostly prefill (the conformance suite's pressure prompts), so tests/conftest.py
serves its engines in float32 (KVHINT_ENGINE_DTYPE, engine_integration/served.py).

For each preset: one engine per dtype, served one after the other with the tests' EngineSpec; the
same unique prompts of a conformance session prompt's length (25 blocks of 32 tokens plus half a
block, 816 tokens: none is a prefix hit) go to each, one request at a time, `max_tokens=1`; then
one decode of 64 tokens. Reported: the engine start, the median and total prefill request time,
the decode time, and the float32 / default ratios.

    python -m bench.engine_dtype [--presets tiny,hybrid] [--prompts 8] [--out bench/results/engine_dtype.md]

Writes the table (.md) and the raw timings (.json, same name).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from bench.report import git, machine
from engine_integration.served import EngineSpec, ServedEngine, default_model
from kvhint_client.openai_traffic import complete

PROMPT_TOKENS = 816
DECODE_TOKENS = 64
DTYPES = (("", "vLLM's default (auto: bfloat16)"), ("float32", "--dtype float32"))


def _cpu_flags() -> str:
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "?"
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
    return ", ".join(f for f in wanted if f in flags) or "none of avx2/avx512/amx"


def measure(preset: str, dtype: str, prompts: int, seed: int) -> dict[str, Any]:
    spec = EngineSpec(model=default_model(preset), dtype=dtype, env={"VLLM_SERVER_DEV_MODE": "1"})
    return {"preset": preset, "dtype": dtype or "auto", **timed_serve(spec, prompts, seed)}


def timed_serve(spec: EngineSpec, prompts: int, seed: int) -> dict[str, Any]:
    """Serve `spec`, time its start, `prompts` unique PROMPT_TOKENS-token prefill requests (one at a
    time, max_tokens 1) and one DECODE_TOKENS-token decode, and stop it (bench.engine_executor too)."""
    model = spec.model
    engine = ServedEngine(spec)
    started = time.monotonic()
    engine.start()
    start_s = time.monotonic() - started
    rng = random.Random(seed)
    try:
        prefill = []
        for _ in range(prompts):
            prompt = [rng.randrange(10, 4000) for _ in range(PROMPT_TOKENS)]
            t = time.monotonic()
            out = complete(engine.http_url, prompt, model=model, max_tokens=1)
            prefill.append(time.monotonic() - t)
            assert out.prompt_tokens == PROMPT_TOKENS, out
        t = time.monotonic()
        complete(engine.http_url, [rng.randrange(10, 4000) for _ in range(32)], model=model,
                 max_tokens=DECODE_TOKENS, extra_body={"ignore_eos": True})
        decode_s = time.monotonic() - t
    finally:
        engine.stop()
    return {"start_s": start_s, "prefill_s": prefill, "decode_s": decode_s}


def write_results(out: Path, text: str, commit: str, rows: list[dict[str, Any]]) -> None:
    """The table (.md) and the raw timings (.json, same name); the table on stdout."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"commit": commit, "machine": machine(), "rows": rows}, indent=1) + "\n")
    print(text)


def render(rows: list[dict[str, Any]], args: argparse.Namespace, commit: str, wall: float) -> str:
    lines = [
        "# Served test engines: vLLM's default dtype against float32",
        "",
        f"Command: `python -m bench.engine_dtype --presets {args.presets} --prompts {args.prompts}`. Machine: {machine()}; "
        f"CPU flags: {_cpu_flags()}; commit {commit}. Engines served with the tests' EngineSpec (80 blocks of 32 tokens), "
        f"one at a time; {args.prompts} unique prompts of {PROMPT_TOKENS} tokens each (max_tokens 1, one request at a "
        f"time), then one decode of {DECODE_TOKENS} tokens. Wall time {wall / 60:.1f} min.",
        "",
        "| preset | dtype | engine start (s) | median prefill request (s) | all prefill requests (s) | decode (s) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        label = dict(DTYPES)["" if r["dtype"] == "auto" else r["dtype"]]
        lines.append(f"| {r['preset']} | {label} | {r['start_s']:.1f} | {statistics.median(r['prefill_s']):.3f} | "
                     f"{sum(r['prefill_s']):.2f} | {r['decode_s']:.2f} |")
    lines += ["", "Ratios, float32 / default, per preset:", ""]
    lines += ["| preset | median prefill request | all prefill requests | decode |", "|---|---|---|---|"]
    for preset in args.presets.split(","):
        by = {r["dtype"]: r for r in rows if r["preset"] == preset}
        if {"auto", "float32"} <= set(by):
            a, f = by["auto"], by["float32"]
            lines.append(f"| {preset} | {statistics.median(f['prefill_s']) / statistics.median(a['prefill_s']):.2f}x | "
                         f"{sum(f['prefill_s']) / sum(a['prefill_s']):.2f}x | {f['decode_s'] / a['decode_s']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny,hybrid")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/engine_dtype.md"))
    args = parser.parse_args(argv)
    if args.prompts < 1:
        parser.error("--prompts must be at least 1")
    commit = git("rev-parse", "--short", "HEAD")
    started = time.monotonic()
    rows = [measure(preset, dtype, args.prompts, args.seed) for preset in args.presets.split(",") for dtype, _ in DTYPES]
    write_results(args.out, render(rows, args, commit, time.monotonic() - started), commit, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
