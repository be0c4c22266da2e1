"""`bench.engine_gc`: the table from raw figures, and on a real engine, that deferred
bookkeeping's settler runs the young collections with generation 1's threshold scaled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import engine_gc

REPO = Path(__file__).resolve().parents[2]


def _run(mode: str, collections: list[dict]) -> dict:
    return {"mode": mode, "steps": 1000, "requests": 10, "thresholds": [700, 10, 10], "bookkeeping": None,
            "ms_per_step": 1.0, "moved_to_oldest": 5000, "collections": collections}


def test_the_table_counts_each_generation_and_the_engine_threads_share() -> None:
    run = _run("deferred", [
        {"generation": 0, "thread": "MainThread", "count": 3, "ms_mean": 1.0, "ms_max": 1.0, "ms_total": 3.0},
        {"generation": 0, "thread": "kvhint-settler", "count": 7, "ms_mean": 1.0, "ms_max": 2.0, "ms_total": 7.0},
        {"generation": 1, "thread": "kvhint-settler", "count": 2, "ms_mean": 5.0, "ms_max": 6.0, "ms_total": 10.0},
        {"generation": 2, "thread": "MainThread", "count": 1, "ms_mean": 80.0, "ms_max": 80.0, "ms_total": 80.0},
    ])
    t = engine_gc.totals(run)
    assert t[0] == {"count": 10, "engine_thread": 3, "ms_total": 10.0, "ms_max": 2.0}
    assert t[1]["count"] == 2 and t[1]["engine_thread"] == 0 and t[2]["engine_thread"] == 1
    text = engine_gc.markdown({"command": "python -m bench.engine_gc", "commit": "abc1234", "steps": 1000,
                               "runs": [run, _run("stock", [])]})
    row = next(line for line in text.splitlines() if line.startswith("| deferred |"))
    # young, gen 1, full; on the engine thread; gen 1 and full ms each; GC ms per 1000 steps; moved per 1000
    assert "| 10 | 2 | 1 | 3 / 0 / 1 | 5.0 | 80.0 | 100 | 5,000 |" in row
    assert "| stock | (700, 10, 10) | 0 | 0 | 0 | 0 / 0 / 0 | - | - | 0 |" in text
    assert "by type" not in text  # no run listed types


def test_the_types_table_lists_each_modes_types_per_1000_steps() -> None:
    run = _run("deferred", []) | {"looked_at_by_type": {"builtins.list": 4000, "kvhint_server.index.Node": 1500}}
    text = engine_gc.markdown({"command": "c", "commit": "abc1234", "steps": 2000, "runs": [run, _run("stock", [])]})
    assert "| deferred | `builtins.list` | 2,000 |" in text and "| deferred | `kvhint_server.index.Node` | 750 |" in text
    assert "| stock | `" not in text


@pytest.mark.engine
@pytest.mark.timeout(300)
def test_a_deferred_engine_collects_on_the_settler_with_generation_1_scaled() -> None:
    pytest.importorskip("vllm", reason="needs vllm (pip install 'kvhint[vllm]')")
    proc = subprocess.run(
        [sys.executable, "-m", "bench.engine_gc", "--child", "deferred", "--steps", "40"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")},
        capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith(engine_gc.RESULT_PREFIX)]
    run = json.loads(line[len(engine_gc.RESULT_PREFIX):])
    assert run["bookkeeping"] == "deferred"
    from kvhint_server.journal import GENERATION1_SCALE

    assert run["thresholds"][1] == 10 * GENERATION1_SCALE  # CPython's default 10, scaled while the settler runs
    settler = sum(c["count"] for c in run["collections"] if c["thread"] == "kvhint-settler" and c["generation"] == 0)
    assert settler > 0, run["collections"]
