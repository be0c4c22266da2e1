"""The campaign's table and exit status: a failure or a lost event fails the
campaign; a missed performance target is reported and does not."""

from __future__ import annotations

from pathlib import Path

from bench.campaign import exit_status, report
from bench.campaign_model import PhaseResult


def _raw(*phases: PhaseResult) -> dict:
    return {"mode": "quick", "sizes": {}, "seconds": 1.0, "raw_file": "raw-quick.json", "phases": [p.as_dict() for p in phases]}


def test_a_missed_target_is_reported_and_leaves_the_exit_status_alone(tmp_path: Path) -> None:
    slow = PhaseResult("stuck subscriber", tried=10, lost=0)
    slow.miss("median completion latency 32.0 ms with a stuck subscriber vs 22.5 ms without (target 1.3x + 2 ms)")
    fine = PhaseResult("wire fuzz", tried=5)
    raw = _raw(fine, slow)
    table = report(raw, tmp_path / "results.md", ["--quick"])
    assert exit_status(raw) == 0
    row = next(line for line in table.splitlines() if line.startswith("| stuck subscriber"))
    assert "32.0 ms" in row and "(target 1.3x + 2 ms)" in row
    assert next(line for line in table.splitlines() if line.startswith("| wire fuzz")).split("|")[5].strip() == "none"
    assert "| **all** | **15** | **0** | **0** | **1** |" in table


def test_a_failure_or_a_lost_event_fails_the_campaign() -> None:
    failed = PhaseResult("routers", tried=3, lost=0)
    failed.fail("a follower did not go live within 30 s")
    assert exit_status(_raw(failed)) == 1
    assert exit_status(_raw(PhaseResult("routers", tried=3, lost=2))) == 1
    assert exit_status(_raw(PhaseResult("routers", tried=3, lost=0))) == 0


def test_raw_files_written_before_missed_targets_existed_still_report(tmp_path: Path) -> None:
    old = PhaseResult("wire fuzz", tried=5).as_dict()
    del old["missed"]
    table = report({**_raw(), "phases": [old]}, tmp_path / "r.md", None)
    assert "| wire fuzz | 5 | 0 | - | none |" in table
