"""examples/router_policy.py against a served engine: the OpenAI proxy a router deploys with no
agent-side change. Its scripted demo sends chat completions (one agent streaming, one not)
through the proxy with X-Session-ID; the proxy forwards them unchanged, and the policy behind
it hints the engine. The sessions must reach the engine through the proxy (ListSessions), each
ended session must get a Release the engine ACCEPTED, and every completion must succeed."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from engine_support import Engine

from engine_integration.served import free_port
from kvhint_client import KvHintClient

pytestmark = pytest.mark.engine

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "router_policy.py"


def test_router_example_demo_hints_the_sessions_it_proxies(clean: Engine) -> None:
    listen = f"127.0.0.1:{free_port()}"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--upstream", clean.http, "--kvhint", clean.grpc_address,
         "--listen", listen, "--demo"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    statuses = [line for line in proc.stderr.splitlines() if line.startswith("demo:")]
    assert len(statuses) == 6 and all(line.endswith("HTTP 200") for line in statuses), proc.stderr[-3000:]
    # Each turn reports what the engine served from its cache (streaming too, through the usage
    # chunk); a later turn of a conversation resent whole reuses its earlier turns.
    cached = [re.search(r"turn (\d+): (\d+) of (\d+) prompt tokens cached", line) for line in statuses]
    assert all(cached), statuses
    assert all(int(m.group(2)) > 0 for m in cached if m and m.group(1) != "0"), statuses
    report = json.loads(proc.stdout)
    releases = {line for line in report["hints"] if line.startswith("release ")}
    assert releases == {"release demo-agent-a -> OUTCOME_ACCEPTED", "release demo-agent-b -> OUTCOME_ACCEPTED"}, report
    assert not [line for line in report["hints"] if line.endswith("OUTCOME_REJECTED")], report
    # Released sessions leave the index: the engine knew them (the Release was ACCEPTED, not
    # REJECTED/NOT_FOUND) and no longer lists them.
    with KvHintClient(clean.grpc_address) as client:
        listed = [s.session_id for s in client.list_sessions_page(prefix="demo-agent", timeout=30).sessions]
    assert listed == []
