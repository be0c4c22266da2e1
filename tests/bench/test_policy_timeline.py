"""The hint policy in the two-phase model of an engine run (bench.policy_timeline): the policy's
hints steer the victims of `lru_timeline`, so a recorded engine run's savings can be put against
LRU and Belady under the same overlap."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import policy_timeline
from bench.agentic_report import belady_timeline, lru_timeline
from bench.generate import PRESETS, generate_trace
from bench.policy_timeline import RunTimes, policy_timeline as run_policy
from bench.simulate import compile_trace

REPO = Path(__file__).resolve().parents[2]


def _recomputed(bt, cached) -> int:
    return sum(r.num_prompt_tokens - (c or 0) for r, c in zip(bt.requests, cached))


def _trace_timeline(preset: str, seed: int):
    """The trace's own schedule (up to `concurrency` agents in flight, overlapping requests)."""
    trace = generate_trace(PRESETS[preset], seed, preset=preset)
    bt = compile_trace(trace)
    admit = [r.t for r in bt.requests]
    return trace, bt, RunTimes(admit, admit, [max(r.t_done, r.t + 1e-6) for r in bt.requests])


class _Silent:
    """A policy that hears everything and sends nothing."""

    def __init__(self) -> None:
        self.heard: list[str] = []

    def start(self, t):
        return []

    def request(self, sid, t):
        self.heard.append("request")
        return []

    def completed(self, sid, t):
        self.heard.append("completed")

    def observe(self, sig):
        self.heard.append(sig.kind)
        return []

    def tick(self, t):
        return []


def test_a_policy_that_sends_nothing_leaves_lru_order() -> None:
    trace, bt, times = _trace_timeline("default", 0)
    silent = _Silent()
    cached, _ = run_policy(trace, bt, times, policy=silent)
    lru, _ = lru_timeline(bt, times.admit, times.finish, queue=True)
    assert cached == lru
    n = len(bt.requests)
    assert silent.heard.count("request") == n and silent.heard.count("completed") == n
    assert silent.heard.count("tool_call_started") == sum(1 for s in trace.signals() if s.kind == "tool_call_started")


@pytest.mark.parametrize("preset,seed", [("default", 0), ("heldout", 1001)])
def test_hints_save_and_true_resume_times_capture_the_overlapped_belady(preset: str, seed: int) -> None:
    trace, bt, times = _trace_timeline(preset, seed)
    lru = _recomputed(bt, lru_timeline(bt, times.admit, times.finish, queue=True)[0])
    belady = _recomputed(bt, belady_timeline(bt, times.admit, times.finish, queue=True)[0])
    policy = _recomputed(bt, run_policy(trace, bt, times)[0])
    oracle = _recomputed(bt, run_policy(trace, bt, times, clairvoyant=True)[0])
    assert belady < policy < lru  # the causal policy saves, and less than the clairvoyant reference
    assert (lru - oracle) / (lru - belady) >= 0.99  # exact predictions: the engine order is Belady's


@pytest.mark.parametrize("name", ["timeline", "timeline_without_keep"])
def test_the_committed_timeline_tables_are_the_tools_output(name: str) -> None:
    folder = REPO / "bench" / "results" / "policy"
    committed = json.loads((folder / f"{name}.json").read_text())
    fresh = [{**policy_timeline.analyze_dir(REPO / r["dir"], r["policy_overrides"]), "dir": r["dir"]}
             for r in committed["results"]]
    assert fresh == committed["results"]
    assert policy_timeline.markdown(fresh, committed["generated_by"]) == (folder / f"{name}.md").read_text()


def test_a_policy_field_that_does_not_exist_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as err:
        policy_timeline.main([str(REPO / "bench" / "results" / "default-seed0-policy-908a119"), "--policy-set", "quantil=0.5"])
    assert err.value.code == 2
    assert "--policy-set quantil=0.5" in capsys.readouterr().err


def test_a_repeat_with_a_failed_request_is_refused_by_name() -> None:
    from bench.agentic_report import load_report

    rep = load_report(REPO / "bench" / "results" / "default-seed0-policy")
    run = rep.runs["lru"][0]
    run.records[3].error = "timed out"
    with pytest.raises(ValueError, match=r"run lru: 1 requests failed \(first r0003\)"):
        RunTimes.of(run)
