"""The costs of KvHint at GPU size: vLLM's real scheduler, KVCacheManager and BlockPool (no
model) with and without the KvHint hooks, pools of 16k / 131k / 524k blocks of 16 tokens, up to
10k live sessions.

  python -m bench.scale                 # full run (~10 min on 2 cores), writes bench/results/scale/
  python bench/scale.py ...             # the same (from the repository root)
  python -m bench.scale --quick         # small sizes (< 1 min), writes /tmp/kvhint-scale-quick/
  python -m bench.scale --report-only   # regenerate RESULTS.md and the plot from the raw data

Each run builds a stock `Scheduler` and a `KvHintScheduler` (engine_integration.inproc) and
feeds both the same agentic workload (bench/scale_workload.py: shared system prompts, sessions
growing turn by turn, a GPU-like admission and eviction rate):

  1. fill: every session's first context, then anonymous prompts until the pool is full,
     admitted directly through the KVCacheManager;
  2. steady: steps with arrivals (`--steps`, after a warm-up), the two schedulers stepping in
     turns; with `hints_per_step`, ApplyHints batches (Retain / Pin / Release) go through
     KvHintCore and the HintExecutor on the engine thread at step boundaries (20 per simulated
     20 ms step = 1k hints/s);
  3. quiet: steps in which nothing changes (resumed sessions decoding inside one block).

Then, on the KvHint side: the memory of its structures, and (one run) ApplyHints apply time
against blocks selected and the event bus with 8 WatchEvents subscribers. An A/A run (stock
against stock) gives the method's noise floor. One more run compares KvHint with a stock
scheduler that publishes vLLM's own KV cache events (its ZMQ publisher, as a KV-aware router
that follows them runs it): the baseline of a router that would follow KvHint's WatchEvents
instead. The targets are checked against plain stock only. One run uses vLLM's
AsyncScheduler on both sides (the GPU default; KvHintScheduler then builds KvHintAsyncScheduler),
stepped as EngineCore.step_with_batch_queue does (engine_integration.inproc).

Bookkeeping (KVHINT_RESIDENCY_BOOKKEEPING, kvhint_server/journal.py): the pool and session runs
are inline; one run is deferred on the synchronous scheduler, and the async run is deferred
(`auto`), next to an async run forced inline. Deferred runs are settled by the driver after each
unit, outside the timed region, and that CPU is recorded apart (kv_settle_ns). Two more runs
sleep 20 ms after each side's step with the GIL free (the device's share of a GPU step) and
let the journal's own settler thread book it, as on an engine; their wall times show whether
the settler made the engine thread wait.

Raw data (raw.json, one units_*.csv per run) and the generated RESULTS.md + scale_loglog.png go
to --out. Targets (issue 12): <= 1.03x scheduler CPU with 10k sessions and no hints; memory
linear in resident blocks plus sessions; no per-step work proportional to pool size or
sessions when nothing changes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__" and not __package__:
    # `python bench/scale.py` (a path, not `-m bench.scale`): run this file as the module
    # bench.scale, whose imports are relative, from the repository root. (As a path, Python
    # also puts bench/ first on sys.path, where bench/trace.py would shadow the standard
    # library's `trace`.)
    import runpy

    sys.path[0] = str(Path(__file__).resolve().parents[1])
    runpy.run_module("bench.scale", run_name="__main__", alter_sys=True)
    sys.exit(0)  # (run_module exits with main()'s status first)

os.environ.setdefault("KVHINT_GRPC_ADDRESS", "127.0.0.1:0")

from .report import command_line, machine  # noqa: E402
from .scale_report import report, write_units  # noqa: E402
from .scale_workload import Shape  # noqa: E402

FULL_OUT = "bench/results/scale"
QUICK_OUT = "/tmp/kvhint-scale-quick"
TITLE = "KvHint at GPU size: scheduler CPU, per-block costs, memory, ApplyHints, events"


@dataclasses.dataclass(frozen=True)
class Run:
    name: str
    shape: Shape
    aa: bool = False  # stock against stock
    probes: bool = False  # ApplyHints sweep and the event bus on this run


def plan(quick: bool, steps: int | None) -> tuple[list[Run], dict[str, Any]]:
    """The runs: pools at the most sessions, sessions at the middle pool, hints, A/A."""
    if quick:
        base: dict[str, Any] = dict(steps=12, warmup_steps=4, quiet_rounds=1, system_tokens=256, first_context_tokens=64,
                                    max_tokens=16, arrivals_per_step=4, max_model_len=1024, max_num_seqs=64)
        pools, sessions, mid, hints, sweep, event_steps, event_count = (1024, 4096), (50, 200), 4096, 10, (1, 16, 64), 10, 2000
        wait = 0.005
    else:
        base = dict(steps=200, quiet_rounds=20)
        wait = 0.02
        pools, sessions, mid, hints, sweep = (16384, 131072, 524288), (100, 1000, 10000), 131072, 20, (1, 16, 64, 256, 1024, 4096)
        event_steps, event_count = 150, 50_000
    if steps is not None:
        base["steps"] = steps
    most = sessions[-1]
    runs = [Run(f"p{p}_s{most}", Shape(p, most, **base), probes=p == mid) for p in pools]
    runs += [Run(f"p{mid}_s{s}", Shape(mid, s, **base)) for s in sessions[:-1]]
    runs.append(Run(f"p{mid}_s{most}_hints", Shape(mid, most, hints_per_step=hints, **base)))
    # The smallest pool with hints too: the quiet-step verdict with grants compares two pool sizes.
    runs.append(Run(f"p{pools[0]}_s{most}_hints", Shape(pools[0], most, hints_per_step=hints, **base)))
    runs.append(Run(f"p{mid}_s{most}_vs_events", Shape(mid, most, stock_kv_events=True, **base)))
    runs.append(Run(f"p{mid}_s{most}_deferred", Shape(mid, most, bookkeeping="deferred", **base)))
    runs.append(Run(f"p{mid}_s{most}_async", Shape(mid, most, async_scheduling=True, **base)))  # auto: deferred
    runs.append(Run(f"p{mid}_s{most}_async_inline", Shape(mid, most, async_scheduling=True, bookkeeping="inline", **base)))
    # Hints under the GPU default (async scheduling, so deferred bookkeeping): grants are in effect
    # throughout, and deferral goes on (the retention ledger is the engine thread's own).
    runs.append(Run(f"p{mid}_s{most}_async_hints", Shape(mid, most, async_scheduling=True, hints_per_step=hints, **base)))
    # Grants in effect and no hint changing (hints in the warm-up only, TTLs past the run), deferred
    # as above and inline (what deferred bookkeeping fell back to while any grant was in effect).
    for mode in ("auto", "inline"):
        runs.append(Run(f"p{mid}_s{most}_async_grants" + ("_inline" if mode == "inline" else ""),
                        Shape(mid, most, async_scheduling=True, bookkeeping=mode, hints_per_step=hints, hints_in_warmup_only=True,
                              hint_ttl_steps=10_000, **base)))
    # A GPU-like duty cycle (each step then a device wait with the GIL free), the settler as a real
    # thread: does its work delay the engine thread (wall time) while it books the last step?
    for mode in ("inline", "auto"):
        runs.append(Run(f"p{mid}_s{most}_async_{mode}_wait", Shape(mid, most, async_scheduling=True, bookkeeping=mode,
                                                                   settler_thread=True, gpu_wait_s=wait, **base)))
    runs.append(Run(f"aa_p{mid}_s{most}", Shape(mid, most, **base), aa=True))
    return runs, {"sweep": sweep, "event_steps": event_steps, "event_count": event_count, "attribution_steps": 6 if quick else 60,
                  "gc_repeats": 1 if quick else 3, "gc_probes_only": quick, "collect": not quick,
                  "owners": (1, 10, 50) if quick else (1, 10, 100, 1000)}


def execute(run: Run, extras: dict[str, Any], out_dir: Path, raw: dict[str, Any]) -> dict[str, Any]:
    from .scale_driver import Pair
    from .scale_probes import apply_sweep, attribution, event_bus, memory, quiet_lines, shared_sweep

    t0 = time.monotonic()
    pair = Pair(run.shape, aa=run.aa, collect=extras["collect"])
    try:
        fill = pair.run()
        entry: dict[str, Any] = {
            "name": run.name,
            "label": ("A/A stock vs stock, " if run.aa else "") + run.shape.label,
            "aa": run.aa,
            "shape": dataclasses.asdict(run.shape),
            "fill": fill,
            "schedulers": [type(pair.stock.sched).__name__, type(pair.kv.sched).__name__],
            "units_csv": f"units_{run.name}.csv",
        }
        if not run.aa:
            entry["quiet_lines"] = quiet_lines(pair)
        # (the events and device-wait runs' KvHint sides are the same as their twins')
        if not run.aa and not run.shape.stock_kv_events and not run.shape.gpu_wait_s:
            # Quick runs time one full collection, on the probes' run: each costs most of a second
            # in a test process, and quick timings are not results.
            gc_repeats = extras["gc_repeats"] if run.probes or not extras["gc_probes_only"] else 0
            entry["memory"] = memory(pair.kv, gc_repeats)
            if pair.sender is not None and pair.sender.batches:
                entry["hint_batches"] = pair.sender.batches
            if not run.shape.hints_per_step:
                entry["attribution"] = attribution(pair, extras["attribution_steps"])
        if run.probes:
            raw["events"] = {"run": run.shape.label, **event_bus(pair, extras["event_steps"], extras["event_count"])}
            raw["apply_sweep"] = {"run": run.shape.label, "rows": apply_sweep(pair.kv, extras["sweep"]),
                                  "shared": shared_sweep(pair.kv, extras["owners"])}
        write_units(out_dir / entry["units_csv"], [u.row() for u in pair.units])
        entry["wall_s"] = round(time.monotonic() - t0, 1)
        return entry
    finally:
        pair.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, < 1 min (for tests)")
    parser.add_argument("--steps", type=int, default=None, help="steady steps per run (default 200; quick 12)")
    parser.add_argument("--only", action="append", default=[], help="run only these run names (repeatable)")
    parser.add_argument("--out", default=None, help=f"output folder (default {FULL_OUT}; quick {QUICK_OUT})")
    parser.add_argument("--report-only", action="store_true", help="regenerate RESULTS.md and the plot from raw data")
    args = parser.parse_args(argv)
    out_dir = Path(args.out or (QUICK_OUT if args.quick else FULL_OUT))
    raw_path = out_dir / "raw.json"
    if args.report_only:
        raw = json.loads(raw_path.read_text())
        print(report(out_dir, TITLE, raw["command"]))
        return 0

    import vllm

    out_dir.mkdir(parents=True, exist_ok=True)
    runs, extras = plan(args.quick, args.steps)
    if args.only:
        runs = [r for r in runs if r.name in args.only]
    shape = runs[0].shape
    raw: dict[str, Any] = {
        "command": command_line("bench.scale", argv),
        "machine": machine(),
        "vllm": vllm.__version__,
        "step_seconds": shape.step_seconds,
        "workload": (
            f"{shape.arrivals_per_step} turns arrive (idle sessions drawn uniformly), each {shape.new_tokens_per_turn} new "
            f"tokens after a {shape.system_tokens}-token system prompt (one of {shape.system_prompts}, shared) and the "
            f"session's context (starts at {shape.first_context_tokens} tokens, grows by prompt + {shape.max_tokens} output "
            f"tokens per turn, the session ends at {shape.max_model_len} tokens and a new one takes its place); "
            f"max_num_seqs {shape.max_num_seqs}, max_num_batched_tokens {shape.max_num_batched_tokens}; "
            f"{shape.steps} measured steps per run after {shape.warmup_steps} warm-up steps"
        ),
        "runs": [],
    }
    t0 = time.monotonic()
    for run in runs:
        print(f"[bench.scale] {run.name}: {run.shape.label}{' (A/A)' if run.aa else ''}", flush=True)
        raw["runs"].append(execute(run, extras, out_dir, raw))
        raw["wall_s"] = round(time.monotonic() - t0, 1)
        raw_path.write_text(json.dumps(raw, indent=1))
        print(f"[bench.scale] {run.name} done in {raw['runs'][-1]['wall_s']} s", flush=True)
    print(report(out_dir, TITLE, raw["command"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
