"""`kvhint demo`, the README's first command, end to end: it starts its own engine (vLLM on CPU
with the sidecar, the generated tiny model), runs the two-agent scenario without and with a Pin,
and shows the pinned agent's resume keeping its whole context cached where the unhinted one lost
it to the other agent's traffic."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine_integration import demo

pytestmark = pytest.mark.engine

# One row of the demo's table: variant, agent, turn, prompt tokens, cached tokens, result, TTFT.
ROW = re.compile(r"^(no-hint|pin)\s+([AB])\s+(\d+)\s+(\d+)\s+(\d+)\s+(hit|partial|miss)\s+[\d.]+$")


@pytest.mark.timeout(600)
def test_kvhint_demo_shows_the_pinned_resume_keeping_its_context(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvhint_client.cli", "demo", "--log", str(tmp_path / "engine.log")],
        capture_output=True, text=True, timeout=540,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = {(m[1], m[2], m[3]): (int(m[4]), int(m[5]), m[6]) for m in map(ROW.match, proc.stdout.splitlines()) if m}
    # Both variants: A's first turn, B's four turns, A's resume.
    assert len(rows) == 12, proc.stdout
    assert "A starts a tool call -> Pin(session=agent-a-pin, ttl=30s): ACCEPTED" in proc.stdout
    context = demo.SYSTEM_TOKENS + demo.TASK_TOKENS  # what A's resume can reuse: its first turn's prompt
    prompt, cached, result = rows[("pin", "A", "2")]
    assert (prompt, cached, result) == (context + demo.TOOL_RESULT_TOKENS, context, "hit"), proc.stdout
    # Without the hint, B's turns evicted A's context: only the prefix B shares stays cached.
    prompt, cached, result = rows[("no-hint", "A", "2")]
    assert cached < context and result != "hit", proc.stdout
    assert f"with a Pin it reused {context} of {context + demo.TOOL_RESULT_TOKENS}" in proc.stdout
