"""bench.suite_time: the suite's time per tier and per module from pytest's JUnit reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.suite_time import engine_tests, main, summarize


def _tree(root: Path) -> None:
    (root / "tests" / "engine").mkdir(parents=True)
    (root / "tests" / "engine" / "test_served.py").write_text("import pytest\n\npytestmark = pytest.mark.engine\n")
    (root / "tests" / "bench").mkdir(parents=True)
    (root / "tests" / "bench" / "test_mixed.py").write_text(
        "import pytest\n\n\ndef test_offline():\n    pass\n\n\n@pytest.mark.engine\n@pytest.mark.timeout(9)\n"
        "def test_served_run():\n    pass\n")


def _report(path: Path, wall: float, cases: list[tuple[str, str, float]], failures: int = 0) -> Path:
    rows = "".join(f'<testcase classname="{c}" name="{n}" time="{t}"/>' for c, n, t in cases)
    path.write_text(f'<testsuites><testsuite name="pytest" failures="{failures}" errors="0" time="{wall}">{rows}'
                    "</testsuite></testsuites>")
    return path


def test_tiers_follow_the_engine_marker_of_modules_and_functions(tmp_path: Path) -> None:
    _tree(tmp_path)
    marked = engine_tests(tmp_path)
    assert marked == ({"tests.engine.test_served"}, {("tests.bench.test_mixed", "test_served_run")})
    run = summarize(_report(tmp_path / "a.xml", 100.0, [
        ("tests.engine.test_served", "test_a", 30.0),
        ("tests.engine.test_served.TestGroup", "test_b[dense]@engine", 20.0),
        ("tests.bench.test_mixed", "test_served_run", 25.0),
        ("tests.bench.test_mixed", "test_offline", 5.0),
        ("tests.unit.test_x", "test_y", 1.5),
    ], failures=1), marked)
    assert run["tiers"] == {"engine": 75.0, "fast": 6.5} and run["tier_tests"] == {"engine": 3, "fast": 2}
    assert run["modules"]["tests.engine.test_served"] == 50.0 and run["wall_s"] == 100.0 and run["failures"] == 1


def test_the_report_puts_runs_side_by_side(tmp_path: Path, monkeypatch) -> None:
    _tree(tmp_path)
    monkeypatch.setattr("bench.suite_time.ROOT", tmp_path)
    a = _report(tmp_path / "a.xml", 100.0, [("tests.engine.test_served", "test_a", 90.0), ("tests.unit.test_x", "t", 4.0)])
    b = _report(tmp_path / "b.xml", 80.0, [("tests.engine.test_served", "test_a", 70.0), ("tests.unit.test_x", "t", 5.0)])
    out = tmp_path / "out" / "suite_time.md"
    assert main([f"before={a}", f"after={b}", "--about", "after=commit abc", "--out", str(out)]) == 0
    text = out.read_text()
    assert "- after: commit abc" in text and "| measure | before | after |" in text and "| wall time (s) | 100 | 80 |" in text
    assert "| engine tier: tests, summed time (s) | 1, 90 | 1, 70 |" in text
    assert "| `tests.engine.test_served` | 90 | 70 |" in text
    assert set(json.loads(out.with_suffix(".json").read_text())) == {"before", "after"}


def test_about_must_name_a_run(tmp_path: Path) -> None:
    a = _report(tmp_path / "a.xml", 1.0, [])
    with pytest.raises(SystemExit):
        main([f"run={a}", "--about", "other=text", "--out", str(tmp_path / "o.md")])


def test_a_run_in_two_parts_adds_them_up(tmp_path: Path, monkeypatch) -> None:
    _tree(tmp_path)
    monkeypatch.setattr("bench.suite_time.ROOT", tmp_path)
    whole = _report(tmp_path / "whole.xml", 100.0, [("tests.engine.test_served", "test_a", 90.0), ("tests.unit.test_x", "t", 4.0)])
    fast = _report(tmp_path / "fast.xml", 3.0, [("tests.unit.test_x", "t", 5.0)])
    engine = _report(tmp_path / "engine.xml", 70.0, [("tests.engine.test_served", "test_a", 65.0)], failures=1)
    out = tmp_path / "suite_time.md"
    assert main([f"one={whole}", f"split={fast}+{engine}", "--out", str(out)]) == 0
    text = out.read_text()
    assert "| wall time (s) | 100 | 73 |" in text and "| tests (failed) | 2 (0) | 2 (1) |" in text
    assert "| engine tier: tests, summed time (s) | 1, 90 | 1, 65 |" in text and "| fast tier: tests, summed time (s) | 1, 4 | 1, 5 |" in text
    assert f"split={tmp_path.name}" not in text and "split=bench/results/suite_time/fast.xml+bench/results/suite_time/engine.xml" in text
    assert json.loads(out.with_suffix(".json").read_text())["split"]["parts_wall_s"] == [3.0, 70.0]


def test_runs_at_the_same_time_count_their_longest_wall_time(tmp_path: Path, monkeypatch) -> None:
    """Two pytest processes run at once (bench/results/engine_lanes_ab.md's lanes): the part's wall
    time is the longer one's."""
    _tree(tmp_path)
    monkeypatch.setattr("bench.suite_time.ROOT", tmp_path)
    fast = _report(tmp_path / "fast.xml", 3.0, [("tests.unit.test_x", "t", 5.0)])
    pool = _report(tmp_path / "pool.xml", 70.0, [("tests.engine.test_served", "test_a", 65.0)])
    own = _report(tmp_path / "own.xml", 50.0, [("tests.engine.test_served", "test_b", 45.0)], failures=1)
    out = tmp_path / "suite_time.md"
    assert main([f"lanes={fast}+{pool},{own}", "--out", str(out)]) == 0
    text = out.read_text()
    assert "| wall time (s) | 73 |" in text and "| tests (failed) | 3 (1) |" in text
    assert "| engine tier: tests, summed time (s) | 2, 110 |" in text
    assert "lanes=bench/results/suite_time/fast.xml+bench/results/suite_time/pool.xml,bench/results/suite_time/own.xml" in text
    assert json.loads(out.with_suffix(".json").read_text())["lanes"]["parts_wall_s"] == [3.0, 70.0]
