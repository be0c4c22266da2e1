"""The reliability campaign's quick mode (bench.campaign --quick) against a
served engine: every phase runs, and none fails or loses an event.

Missed performance targets (a latency ratio on a shared 2-core machine) are
measurements: the table reports them, and this test only checks that each
one is reported with its figure. The behaviour behind each target is a
failure and fails here: for the stuck subscriber, an engine that waits on
the stuck stream (completions slower by half the stall threshold)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import campaign

pytestmark = pytest.mark.engine

PHASES = {"wire fuzz", "routers", "kill and restart", "stuck subscriber", "bad configuration", "growth (core)", "growth (served)"}


def test_quick_campaign_has_no_failure_and_loses_nothing(tmp_path: Path) -> None:
    rc = campaign.main(["--quick", "--out-dir", str(tmp_path)])
    raw = json.loads((tmp_path / "raw-quick.json").read_text())
    phases = raw["phases"]
    assert len(phases) == len(PHASES)
    for phase in phases:
        assert phase["tried"] > 0, phase["phase"]
        assert phase["failed"] == 0, (phase["phase"], phase["failures"][:5])
        assert (phase["lost"] or 0) == 0, (phase["phase"], phase["details"])
    assert rc == 0
    table = (tmp_path / "results-quick.md").read_text()
    assert "| **all** |" in table
    for phase in phases:
        for missed in phase["missed"]:
            assert "target" in missed and missed.replace("|", "/") in table, missed
    stuck = next(p for p in phases if p["phase"] == "stuck subscriber")
    assert stuck["details"]["overflow_resync"] is True and stuck["details"]["loaded_median_ms"] > 0
