"""kvhint-conformance against a target that cannot answer: a mistyped --target (nothing listening)
was 134 failed cases after the RPC deadline, each "GetCapabilities failed: DEADLINE_EXCEEDED", and
exit 1, as if the engine had failed every MUST. Now one line on stderr and exit 3, no case run; a
token the target refuses is said the same way."""

from __future__ import annotations

import io
import json
import re
import socket
import sys
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS / "unit")]

from kvhint_unit_support import Harness, local_engine_info  # noqa: E402

from conformance.runner import EXIT_UNREACHABLE, main  # noqa: E402


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens there once the socket closes


def _run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(list(argv), out=out), out.getvalue()


def test_nothing_listening_is_one_message_and_exit_3(capsys: pytest.CaptureFixture[str]) -> None:
    target = f"127.0.0.1:{_closed_port()}"
    started = time.monotonic()
    rc, text = _run("--target", target, "--openai-url", "http://127.0.0.1:1", "--rpc-timeout", "1")
    assert rc == EXIT_UNREACHABLE == 3
    assert time.monotonic() - started < 10
    assert "FAILED" not in text and "passed" not in text, text  # no case ran
    err = capsys.readouterr().err
    assert f"kvhint-conformance: cannot reach the target {target}: no answer to GetCapabilities within 1s (UNAVAILABLE:" in err
    assert "no case was run" in err


def test_a_refused_token_is_one_message_and_exit_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": [{"name": "ops", "role": "admin", "tokens": ["tok-ops"]}]}))
    harness = Harness(local_engine_info(), tenants_file=str(path))
    try:
        target = f"127.0.0.1:{harness.port}"
        rc, text = _run("--target", target, "--token", "not-the-token", "--rpc-timeout", "5")
        assert rc == 3 and "FAILED" not in text, text
        assert f"the target {target} refused the credentials (--token)" in capsys.readouterr().err
        # The right token: the cases run (the capability cases, which need no traffic).
        rc, text = _run("--target", target, "--token", "tok-ops", "--rpc-timeout", "5", "--run", "^kvhint.v1/capabilities/")
        assert rc == 0 and re.search(r"^PASS: [1-9]\d* passed, 0 failed", text, re.M), text
    finally:
        harness.close()
