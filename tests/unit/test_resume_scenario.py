"""scripts/resume_scenario.py without an engine: what it reads from buf curl's JSON, and its exit
status when it cannot run (the engine runs are in tests/engine/test_engine_wire.py and
test_engine_window.py)."""

from __future__ import annotations

import http.server
import importlib.util
import json
import shutil
import socket
import sys
import threading
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


class _Engine(http.server.BaseHTTPRequestHandler):
    """An OpenAI endpoint that lists a model and counts the completions it is sent."""

    completions = 0

    def do_GET(self) -> None:  # noqa: N802
        self._json({"data": [{"id": "m"}]})

    def do_POST(self) -> None:  # noqa: N802
        type(self).completions += 1
        self._json({"usage": {"prompt_tokens_details": {"cached_tokens": 0}}})

    def _json(self, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


def test_an_unreachable_sidecar_is_exit_status_2_before_any_prompt(capsys: pytest.CaptureFixture[str]) -> None:
    """A wrong --grpc failed only at the Pin, with buf's "failed to find service named ..." (what a
    refused connection gives through reflection), after the reference and control prompts had
    been sent to the engine."""
    buf = shutil.which("buf")
    assert buf, "buf (PyPI buf-bin) is installed by scripts/install.sh"
    _Engine.completions = 0
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        grpc = f"127.0.0.1:{_closed_port()}"
        assert rs.main(["--http", f"http://127.0.0.1:{server.server_address[1]}", "--grpc", grpc, "--buf", buf]) == 2
    finally:
        server.shutdown()
    assert f"cannot reach the KvHint sidecar at {grpc} (nothing was sent to the engine)" in capsys.readouterr().err
    assert _Engine.completions == 0


def test_the_token_goes_with_every_hint_and_reflection_request(tmp_path: Path) -> None:
    record = tmp_path / "argv.json"
    fake = tmp_path / "buf"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\njson.dump(sys.argv[1:], open({str(record)!r}, 'w'))\nprint('{{}}')\n")
    fake.chmod(0o755)
    rs.check_sidecar(str(fake), "127.0.0.1:1", "tok-1")
    argv = json.loads(record.read_text())
    assert argv[:2] == ["curl", "--protocol"] and argv[-1] == "http://127.0.0.1:1/kvhint.v1.KvHintService/GetCapabilities"
    assert ["-H", "Authorization: Bearer tok-1", "--reflect-header", "*"] == argv[argv.index("-H"):argv.index("-H") + 4]
    rs.check_sidecar(str(fake), "127.0.0.1:1", None)
    assert "-H" not in json.loads(record.read_text())


def test_negative_pressure_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        rs.main(["--http", "http://x", "--grpc", "x:1", "--fillers", "-1", "--buf", sys.executable])
    assert exit_.value.code == 2 and "--fillers" in capsys.readouterr().err
