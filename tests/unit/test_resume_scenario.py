"""scripts/resume_scenario.py without an engine: what it reads from buf curl's JSON, and its exit
status when it cannot run (the engine runs are in tests/engine/test_engine_wire.py and
test_engine_window.py)."""

from __future__ import annotations

import importlib.util
import socket
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load() -> Any:
    spec = importlib.util.spec_from_file_location("kvhint_resume_scenario", REPO / "scripts" / "resume_scenario.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


rs = _load()


def test_device_blocks_read_proto3_json() -> None:
    result = {"outcome": "OUTCOME_CLIPPED",
              "affectedBlocks": [{"tier": "TIER_DEVICE", "blocks": "12"}, {"tier": "TIER_HOST", "blocks": "3"}]}
    assert rs.device_blocks(result) == 12
    assert rs.device_blocks({"outcome": "OUTCOME_MISSING"}) == 0


def test_prompts_are_reproducible_token_ids() -> None:
    assert rs.tokens("a", 5) == rs.tokens("a", 5) != rs.tokens("b", 5)
    assert all(3 <= t <= 4000 for t in rs.tokens("a", 100))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_engine_is_exit_status_2_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    port = _closed_port()
    assert rs.main(["--http", f"http://127.0.0.1:{port}", "--grpc", f"127.0.0.1:{port}", "--buf", sys.executable]) == 2
    assert f"127.0.0.1:{port}/v1/models" in capsys.readouterr().err


def test_negative_pressure_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        rs.main(["--http", "http://x", "--grpc", "x:1", "--fillers", "-1", "--buf", sys.executable])
    assert exit_.value.code == 2 and "--fillers" in capsys.readouterr().err
