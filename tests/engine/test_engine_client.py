"""The client side against the real engine: the typed Python client, the
`kvhint` CLI as a subprocess (exit codes, --json), KvHintsEnvelope interop,
and the Go router stub."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from engine_support import Engine, release, tokens

from kvhint.v1 import kvhint_pb2 as pb
from kvhint_client import KvHintClient, KvHintError, continuation, session

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]


def kvhint(engine: Engine, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvhint_client.cli", "--address", engine.grpc_address, *args],
        capture_output=True,
        text=True,
        input=stdin,
        timeout=60,
    )


def test_typed_client_round_trip(clean: Engine) -> None:
    clean.complete(tokens("typed"), "typed", continuation_id="typed/1")
    with KvHintClient(clean.grpc_address) as client:
        caps = client.capabilities()
        assert caps.protocol_version == "kvhint.v1"
        result = client.apply(session("typed").pin(ttl=30), continuation("typed/1").retain(ttl=30, priority=4))
        assert result.all_accepted, result
        residency = client.query_residency(session("typed").selector)
        assert len(residency.blocks) == 22
        assert {b.retention.retention_class for b in residency.blocks} == {pb.RetentionState.CLASS_PINNED}
        assert "typed" in {s.session_id for s in client.list_sessions()}
        assert client.health().serving
        missing = client.apply(session("typed-nobody").evict())
        assert not missing.all_accepted and missing[0].outcome == pb.OUTCOME_MISSING
        with pytest.raises(KvHintError) as err:
            client.get_operation("op-unknown")
        assert err.value.reason == "REASON_NOT_FOUND"
        client.apply(session("typed").release())


def test_cli_json_output_and_exit_codes(clean: Engine) -> None:
    clean.complete(tokens("cli"), "cli")
    caps = kvhint(clean, "--json", "capabilities")
    assert caps.returncode == 0, caps.stderr
    assert json.loads(caps.stdout)["protocol_version"] == "kvhint.v1"

    pinned = kvhint(clean, "apply", "pin", "--session", "cli", "--ttl", "30")
    assert pinned.returncode == 0, pinned.stdout + pinned.stderr
    clipped = kvhint(clean, "--json", "apply", "pin", "--session", "cli", "--ttl", "99999")
    assert clipped.returncode == 1  # not ACCEPTED: CLIPPED
    assert json.loads(clipped.stdout)["results"][0]["outcome"] == "OUTCOME_CLIPPED"
    missing = kvhint(clean, "apply", "evict", "--session", "cli-nobody")
    assert missing.returncode == 1 and "MISSING" in missing.stdout

    sessions = kvhint(clean, "--json", "sessions")
    assert sessions.returncode == 0 and "cli" in sessions.stdout
    residency = kvhint(clean, "--json", "residency", "--session", "cli")
    assert residency.returncode == 0
    assert len(json.loads(residency.stdout)["blocks"]) == 22

    usage = kvhint(clean, "apply", "pin")  # no selector
    assert usage.returncode == 2
    refused = subprocess.run(
        [sys.executable, "-m", "kvhint_client.cli", "--address", "127.0.0.1:1", "--timeout", "2", "capabilities"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 3 and "refused" in refused.stderr
    clean.apply(release("cli"))


def test_cli_watch_emits_json_lines(clean: Engine) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvhint_client.cli", "--address", clean.grpc_address, "--json", "watch", "--session", "cli-watch", "--count", "2", "--heartbeat", "30"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    import time

    time.sleep(2.0)
    clean.complete(tokens("cli-watch"), "cli-watch")
    clean.apply(pb.Hint(selector=pb.Selector(session=pb.SessionSelector(session_id="cli-watch")), pin=pb.PinAction(ttl={"seconds": 5})))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    lines = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert len(lines) == 2
    assert "blocks_stored" in lines[0] and lines[0]["blocks_stored"]["coordinates"]["session_id"] == "cli-watch"
    clean.apply(release("cli-watch"))


def test_envelope_drives_the_servicer(clean: Engine) -> None:
    clean.complete(tokens("env"), "env")
    envelope = {
        "protocol_version": "0.1",
        "message_id": "m-1",
        "actions": [
            {"action_id": "a-1", "action_type": "kv.pin", "action_version": "1.0", "payload": {"selector": {"session_id": "env"}, "ttl_seconds": 20}}
        ],
    }
    applied = kvhint(clean, "--json", "apply", "--envelope", "-", stdin=json.dumps(envelope))
    assert applied.returncode == 0, applied.stdout + applied.stderr
    result = json.loads(applied.stdout)["results"][0]
    assert result["hint_id"] == "a-1" and result["outcome"] == "OUTCOME_ACCEPTED"
    envelope["actions"][0]["action_type"] = "kv.teleport"
    rejected = kvhint(clean, "apply", "--envelope", "-", stdin=json.dumps(envelope))
    assert rejected.returncode == 2 and "kv.teleport" in rejected.stderr
    clean.apply(release("env"))


@pytest.mark.skipif(shutil.which("go") is None, reason="Go toolchain not installed (Debian golang-go)")
def test_go_router_stub_calls_the_real_engine(engine: Engine) -> None:
    build = subprocess.run([str(ROOT / "tools" / "build_stubs.sh"), "go"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert build.returncode == 0, build.stdout + build.stderr
    binary = ROOT / "build" / "bin" / "kvhint-capabilities"
    out = subprocess.run([str(binary), "-address", engine.grpc_address, "-timeout", "10s"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "protocol_version: kvhint.v1" in out.stdout
    assert "PIN" in out.stdout and os.path.exists(binary)
