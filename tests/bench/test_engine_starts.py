"""bench/engine_starts.py without engines: what it runs side by side, and the table it writes
from the rounds (the committed bench/results/engine_starts.md must be that table)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from bench.engine_starts import render, side_by_side, summarize

ROOT = Path(__file__).resolve().parents[2]


def test_actions_run_at_the_same_time_and_the_first_error_is_raised() -> None:
    both = threading.Barrier(2)  # only actions running together get through
    assert side_by_side([lambda: both.wait(timeout=5), lambda: both.wait(timeout=5)]) < 5

    def fails() -> None:
        raise RuntimeError("vllm serve exited with 1")

    with pytest.raises(RuntimeError, match="exited"):
        side_by_side([lambda: time.sleep(0.01), fails])


def test_the_summary_is_the_medians_and_their_ratio() -> None:
    rounds = [
        {"shape": "one", "start_s": 36.0, "stop_s": 4.0}, {"shape": "two", "start_s": 38.0, "stop_s": 5.0},
        {"shape": "one", "start_s": 40.0, "stop_s": 6.0}, {"shape": "two", "start_s": 37.0, "stop_s": 4.0},
        {"shape": "one", "start_s": 35.0, "stop_s": 5.0}, {"shape": "two", "start_s": 70.0, "stop_s": 4.5},
    ]  # fmt: skip
    s = summarize(rounds)
    assert s["one"] == {"rounds": 3, "start_s": 36.0, "stop_s": 5.0}
    assert s["two"] == {"rounds": 3, "start_s": 38.0, "stop_s": 4.5}
    assert s["two / one"] == {"start_s": 1.06, "stop_s": 0.9}
    text = render(s, rounds, "python -m bench.engine_starts", "2 cores")
    assert "| two / one | | 1.06x | 0.90x |" in text and "| one | 3 | 36.0 | 5.0 |" in text
    assert "forked" not in text
    forked = [{"shape": "forked", "start_s": 18.0, "stop_s": 5.0}, {"shape": "forked", "start_s": 20.0, "stop_s": 4.0}]
    s = summarize(rounds + forked)
    assert s["forked"] == {"rounds": 2, "start_s": 19.0, "stop_s": 4.5}
    assert s["forked / one"] == {"start_s": 0.53, "stop_s": 0.9}
    text = render(s, rounds + forked, "python -m bench.engine_starts", "2 cores")
    assert "| forked / one | | 0.53x | 0.90x |" in text and "KVHINT_ENGINE_CORE_START=fork" in text


def test_the_committed_table_is_the_scripts_output_from_the_committed_rounds() -> None:
    raw = json.loads((ROOT / "bench/results/engine_starts.json").read_text())
    text = render(summarize(raw["rounds"]), raw["rounds"], raw["command"], raw["machine"])
    assert (ROOT / "bench/results/engine_starts.md").read_text() == text
