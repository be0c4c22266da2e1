"""Belady-MIN under the engine's concurrency (bench.agentic_report.belady_timeline):
the reference a real-engine run's eviction order is measured against when
requests overlap and hold their blocks until they complete."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from bench import agentic_report
from bench.agentic_report import belady_timeline, lru_timeline
from bench.generate import PRESETS, generate_trace
from bench.simulate import compile_trace, simulate_belady

REPO = Path(__file__).resolve().parents[2]


def _recomputed(bt, cached) -> int:
    return sum(r.num_prompt_tokens - (c or 0) for r, c in zip(bt.requests, cached))


@pytest.mark.parametrize("preset,seed", [("default", 0), ("heldout", 1001)])
def test_without_overlap_it_is_sequential_belady(preset: str, seed: int) -> None:
    bt = compile_trace(generate_trace(PRESETS[preset], seed, preset=preset))
    n = len(bt.requests)
    cached, stats = belady_timeline(bt, [float(2 * i) for i in range(n)], [float(2 * i + 1) for i in range(n)])
    assert stats["no_room"] == 0
    assert cached == simulate_belady(bt).cached_tokens


@pytest.mark.parametrize("seed", range(4))
def test_with_overlap_it_recomputes_no_more_than_lru_under_the_same_overlap(seed: int) -> None:
    bt = compile_trace(generate_trace(PRESETS["default"], seed, preset="default"))
    rng = random.Random(seed)
    admit, finish, t = [], [], 0.0
    for _ in bt.requests:  # up to ~4 requests in flight, admitted in trace order
        t += rng.expovariate(1.0)
        admit.append(t)
        finish.append(t + rng.uniform(0.5, 4.0))
    lru, _ = lru_timeline(bt, admit, finish, queue=True)
    belady, stats = belady_timeline(bt, admit, finish, queue=True)
    assert belady.count(None) == stats["never_admitted"]  # counted as full recomputes
    assert _recomputed(bt, belady) <= _recomputed(bt, lru)


def test_a_queued_admission_waits_for_room_and_none_is_lost() -> None:
    bt = compile_trace(generate_trace(PRESETS["default"], 0, preset="default"))
    n = len(bt.requests)
    # Every request admitted at once and completed in order: the pool cannot hold them all.
    admit, finish = [0.0] * n, [float(i + 1) for i in range(n)]
    dropped, dropped_stats = lru_timeline(bt, admit, finish)
    queued, queued_stats = lru_timeline(bt, admit, finish, queue=True)
    assert dropped_stats["no_room"] > 0 and dropped.count(None) == dropped_stats["no_room"]
    assert queued_stats["no_room"] > 0 and queued_stats["never_admitted"] == 0 and None not in queued
    overlapped, stats = belady_timeline(bt, admit, finish, queue=True)
    assert stats["never_admitted"] == 0 and _recomputed(bt, overlapped) <= _recomputed(bt, queued)


COMMITTED = sorted(d.name for d in (REPO / "bench" / "results").iterdir() if (d / "results.json").exists() and (d / "requests.jsonl").exists())


@pytest.mark.parametrize("name", COMMITTED)
def test_every_committed_engine_run_rebuilds_to_its_committed_table(tmp_path: Path, name: str) -> None:
    src = REPO / "bench" / "results" / name
    run = tmp_path / name
    shutil.copytree(src, run)
    assert agentic_report.main(["rebuild", "--no-plot", str(run)]) == 0
    assert (run / "results.md").read_text() == (src / "results.md").read_text()  # the table is the raw data's
    assert json.loads((run / "results.json").read_text()) == json.loads((src / "results.json").read_text())


@pytest.mark.parametrize("name", ["default-seed0-policy", "heldout-seed1001-policy", "default-seed0-policy-908a119", "default-seed0-policy-ec1b9ae"])
def test_the_policy_runs_report_the_share_of_the_overlapped_belady(name: str) -> None:
    src = REPO / "bench" / "results" / name
    data = json.loads((src / "results.json").read_text())
    lru = data["runs"]["lru"]["recomputed_tokens"]
    overlapped = data["offline"]["results"]["belady-concurrent"]
    sequential = data["offline"]["results"]["belady"]["recomputed_tokens"]
    assert sequential < overlapped["recomputed_tokens"] < lru  # overlap leaves any eviction order less to save
    assert overlapped["never_admitted"] == 0
    policy = data["runs"]["policy"]["recomputed_tokens"]
    share = data["goals"]["policy"]["g1_savings_vs_belady_overlapped"]
    assert share == pytest.approx((lru - policy) / (lru - overlapped["recomputed_tokens"]))
    row = next(line for line in (src / "results.md").read_text().splitlines() if line.startswith("| policy |"))
    assert row.rstrip(" |").endswith(f"{share:.2f}")
