"""The reliability campaign's quick mode (bench.campaign --quick) against a
served engine: every phase runs, and none fails or loses an event."""

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
    assert "| **all** |" in (tmp_path / "results-quick.md").read_text()
