"""Scheduler step-time overhead of the KvHint integration with no hints.

Runs the same request stream through two in-process vLLM engines in one
process, the stock Scheduler and KvHintScheduler (sidecar serving, no hints
sent), alternating rounds so machine noise hits both alike. Times every
`Scheduler.schedule()` + `update_from_output()` call (the scheduler's share of
a step, where the hooks live) and the whole engine step, and reports
KvHint/stock ratios of the medians and means.

  python -m bench.step_overhead            # full run (~3 min)
  python -m bench.step_overhead --rounds 2 --requests 24   # quick

Target (issue 2): scheduler step time with the integration loaded and no
hints <= 1.01x stock.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

from bench.report import write_markdown

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engines in this process
os.environ.setdefault("KVHINT_GRPC_ADDRESS", "127.0.0.1:0")


def _prompt(seed: object, n: int) -> list[int]:
    rng = random.Random(str(seed))
    return [rng.randint(3, 4000) for _ in range(n)]


class StepTimer:
    """Wraps one engine's scheduler and step() to record durations."""

    def __init__(self, llm: object) -> None:
        engine = llm.llm_engine  # type: ignore[attr-defined]
        core = engine.engine_core.engine_core
        self.scheduler = core.scheduler
        self.sched_s: list[float] = []
        self.step_s: list[float] = []
        sched = self.scheduler
        orig_schedule, orig_update = sched.schedule, sched.update_from_output
        pending = [0.0]

        def schedule(*a: object, **k: object) -> object:
            t = time.perf_counter()
            out = orig_schedule(*a, **k)
            pending[0] = time.perf_counter() - t
            return out

        def update(*a: object, **k: object) -> object:
            t = time.perf_counter()
            out = orig_update(*a, **k)
            self.sched_s.append(pending[0] + time.perf_counter() - t)
            return out

        sched.schedule, sched.update_from_output = schedule, update
        self.engine = engine

    def run(self, requests: list[tuple[str, list[int], str | None]], max_tokens: int) -> None:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for rid, ids, session in requests:
            self.engine.add_request(rid, {"prompt_token_ids": ids}, params, session_id=session)
        while self.engine.has_unfinished_requests():
            t = time.perf_counter()
            self.engine.step()
            self.step_s.append(time.perf_counter() - t)


def build_engine(model: str, kvhint: bool, num_blocks: int) -> object:
    from vllm import LLM

    kwargs: dict[str, object] = dict(
        block_size=32,
        num_gpu_blocks_override=num_blocks,
        max_model_len=1024,
        gpu_memory_utilization=float(os.environ.get("KVHINT_GPU_MEMORY_UTILIZATION", "0.1")),
        enable_prefix_caching=True,
        seed=0,
    )
    if kvhint:
        kwargs["scheduler_cls"] = "engine_integration.scheduler.KvHintScheduler"
    return LLM(model, **kwargs)


def workload(round_no: int, n: int, sessions: bool) -> list[tuple[str, list[int], str | None]]:
    """Agentic-ish: sessions grow turn by turn (prefix hits) under cache pressure."""
    out = []
    for i in range(n):
        sid = f"s{i % 6}"
        base = _prompt(f"{sid}-{round_no}", 400)
        turn = i // 6
        ids = base + _prompt(f"{sid}-{round_no}-{turn}", 100 * (turn + 1))[: 600 - 100]
        out.append((f"r{round_no}-{i}", ids[:900], sid if sessions else None))
    return out


def summarize(xs: list[float]) -> tuple[float, float]:
    return statistics.median(xs), statistics.fmean(xs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=48, help="requests per round")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=80)
    parser.add_argument("--preset", choices=("tiny", "bench"), default="tiny", help="generated model preset")
    parser.add_argument("--model", default=None, help="model directory (overrides --preset)")
    parser.add_argument("--out", default="bench/results/step_overhead.md")
    args = parser.parse_args(argv)

    from engine_integration.served import default_model

    model = args.model or default_model(args.preset)
    engines = {
        "stock": StepTimer(build_engine(model, False, args.num_blocks)),
        "kvhint": StepTimer(build_engine(model, True, args.num_blocks)),
    }
    for timer in engines.values():  # warm-up (compilation, allocator)
        timer.run(workload(-1, 12, True), args.max_tokens)
        timer.sched_s.clear()
        timer.step_s.clear()
    for r in range(args.rounds):
        order = list(engines.items()) if r % 2 == 0 else list(reversed(engines.items()))
        for name, timer in order:
            timer.run(workload(r, args.requests, sessions=r % 2 == 0), args.max_tokens)
        print(f"round {r + 1}/{args.rounds} done", flush=True)

    rows = []
    stock, kv = engines["stock"], engines["kvhint"]
    for label, a, b in (("scheduler (schedule + update_from_output)", stock.sched_s, kv.sched_s), ("engine step", stock.step_s, kv.step_s)):
        (ma, fa), (mb, fb) = summarize(a), summarize(b)
        rows.append((label, len(a), ma * 1e3, mb * 1e3, mb / ma, fa * 1e3, fb * 1e3, fb / fa))
    lines = [
        "| measure | steps | stock median ms | kvhint median ms | ratio (median) | stock mean ms | kvhint mean ms | ratio (mean) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, n, ma, mb, rm, fa, fb, rf in rows:
        lines.append(f"| {label} | {n} | {ma:.3f} | {mb:.3f} | {rm:.3f}x | {fa:.3f} | {fb:.3f} | {rf:.3f}x |")
    write_markdown(
        args.out,
        "Scheduler step-time overhead, no hints",
        "bench.step_overhead",
        argv,
        [
            f"Model: generated {args.preset} Llama, {args.num_blocks} blocks x 32 tokens; {args.rounds} alternating rounds of "
            f"{args.requests} requests (half the rounds with session ids), max_tokens {args.max_tokens}.",
            "",
            *lines,
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
