"""The real-engine agentic benchmark (bench.agentic_engine).

* Offline pieces (no engine): the closed-loop replay plan reproduces the
  trace's arrival times under its own service model, and the two-phase LRU
  used to validate concurrent runs equals `simulate_lru` when no requests
  overlap.
* Smoke (engine, < 4 min): `python -m bench.agentic_engine --mode fast` with runs
  (a), (b), (f) and (g) as a subprocess. It asserts that the pipeline works:
  every request answered, metrics present, files written, and that the tier
  hints really ran: Demotes came back DEFERRED (not REJECTED), their operations
  completed SUCCEEDED (OperationCompleted events), and (g) served different
  prefix hits than (f), the same tiers without hints. The numbers themselves
  are not checked here (the full run in bench/results/ is the benchmark).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.agentic_engine import build_plan
from bench.agentic_report import lru_timeline
from bench.generate import PRESETS, generate_trace
from bench.simulate import compile_trace, simulate_lru

REPO = Path(__file__).resolve().parents[2]
# The smoke runs: (a) LRU, (b) hints, (f) offload and (g) hints+tiers ((f) and (g) share one tiered engine).
RUNS = ("lru", "hints", "offload", "hints+tiers")


@pytest.mark.parametrize("preset,seed", [("fast", 0), ("default", 0), ("heldout", 1001)])
def test_plan_reproduces_nominal_arrivals(preset, seed):
    tr = generate_trace(PRESETS[preset], seed, preset=preset)
    plan = build_plan(tr)
    assert plan.closed_loop
    reqs = plan.requests
    assert all(d < i for i, ds in enumerate(plan.deps) for d in ds)
    assert sum(len(s) for s in plan.signals_after) + len(plan.timed_signals) == len(tr.signals())
    # replay the plan with the generator's own durations: every request is sent at its trace time
    done = [0.0] * len(reqs)
    for i, r in enumerate(reqs):
        a = plan.anchor[i]
        start = r.t if a is None else done[a] + plan.delay[i]
        start = max([start] + [done[d] for d in plan.deps[i]])
        assert start == pytest.approx(r.t, abs=1e-6), r.request_id
        done[i] = start + (r.t_done - r.t)


def test_two_phase_lru_equals_sequential_lru_without_overlap():
    tr = generate_trace(PRESETS["default"], 0, preset="default")
    bt = compile_trace(tr)
    n = len(bt.requests)
    admit = [float(2 * i) for i in range(n)]
    finish = [float(2 * i + 1) for i in range(n)]
    cached, stats = lru_timeline(bt, admit, finish)
    assert stats["no_room"] == 0
    assert cached == simulate_lru(bt).cached_tokens


def _vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.engine
@pytest.mark.timeout(540)
@pytest.mark.skipif(not _vllm_available(), reason="needs vllm (pip install 'kvhint[vllm]')")
def test_fast_mode_pipeline(tmp_path):
    out = tmp_path / "fast"
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "bench.agentic_engine", "--mode", "fast", "--runs", ",".join(RUNS), "--out", str(out), "--quiet"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")},
        capture_output=True,
        text=True,
        timeout=520,
    )
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-4000:]
    for name in ("results.json", "results.md", "requests.jsonl", "trace.jsonl"):
        assert (out / name).is_file(), name
    res = json.loads((out / "results.json").read_text())
    n = res["trace"]["stats"]["requests"]
    assert set(res["runs"]) == set(RUNS)
    for name, m in res["runs"].items():
        assert m["requests"] == n and m["answered"] == n, name
        for key in ("hit_rate", "recomputed_tokens", "ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms",
                    "throughput_req_s", "peak_blocks_in_use", "pins_broken", "bytes_moved_between_tiers"):
            assert m.get(key) is not None, (name, key)
    assert res["runs"]["hints"]["hints"]["rpcs"] > 0  # hints reached the engine
    tiered = res["runs"]["hints+tiers"]
    demotes = tiered["hints"]["outcomes"]["demote"]
    assert demotes.get("DEFERRED", 0) > 0, f"no Demote was DEFERRED (outcomes {demotes})"
    assert not demotes.get("REJECTED"), f"Demotes were REJECTED on the tiered engine: {demotes}"
    (monitor,) = [r["monitor"] for r in res["runs_raw"]["hints+tiers"]]
    completed = monitor["operations_completed"]
    assert completed.get("STATE_SUCCEEDED", 0) > 0, f"no OperationCompleted with SUCCEEDED ({completed})"
    assert tiered["bytes_moved_between_tiers"] > 0 and res["runs"]["lru"]["bytes_moved_between_tiers"] == 0
    assert {"belady", "infinite"} <= set(res["offline"]["results"])
    assert res["validation"]["sequential"]["requests"] == n
    assert res["validation"]["concurrent"]["requests"] == n
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert len(rows) == len(RUNS) * n and all(r["error"] is None for r in rows)
    # (g) differs from (f), the same tiers without hints: the hints changed what the engine kept.
    hits = {run: [r["cached_tokens"] for r in sorted((r for r in rows if r["run"] == run), key=lambda r: r["index"])]
            for run in ("offload", "hints+tiers")}
    assert hits["hints+tiers"] != hits["offload"], "(g) hints+tiers served exactly the prefix hits of (f) offload"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pass
    else:
        assert (out / "plot.png").stat().st_size > 10_000
    print(f"fast mode took {elapsed:.0f} s")


def test_plan_without_closed_loop_fields_is_open_loop():
    """A recorded trace with only arrival times: requests go out at `t`, still
    after the requests whose outputs they contain."""
    from bench.trace import Request, Trace

    tr = generate_trace(PRESETS["fast"], 0, preset="fast")
    events = [
        dataclasses.replace(e, after=None, delay_s=None, cause=None, t_done=None) if isinstance(e, Request) else e
        for e in tr.events
    ]
    plan = build_plan(Trace(tr.header, events))
    assert not plan.closed_loop
    assert all(a is None for a in plan.anchor)
    idx = {r.request_id: i for i, r in enumerate(plan.requests)}
    for i, r in enumerate(plan.requests):
        for seg in r.prompt:
            if hasattr(seg, "request_id"):
                assert idx[seg.request_id] in plan.deps[i]
