"""examples/router_policy.py's proxy without an engine: a fake KvHint server for the hints and a
fake (or absent) upstream for the chat completions. What a router's proxy must survive: the engine
down or restarting (502, and the session is not left running), a body that is JSON but not an
object, a client that goes away mid-stream (the turn still ends), and a streamed response on a
path other than chat completions (forwarded as it comes, not buffered)."""

from __future__ import annotations

import http.client
import importlib.util
import json
import socket
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from fake_kvhint_server import RunningServer

from kvhint_client import KvHintClient

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "router_policy.py"


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("kvhint_router_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


router_example = _example()


class _Upstream(BaseHTTPRequestHandler):
    """An engine that streams three SSE chunks on any POST, slowly."""

    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i in range(3):
            line = b"data: " + json.dumps({"choices": [{"index": 0, "text": str(i)}]}).encode() + b"\n\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
            self.wfile.flush()
            time.sleep(0.3)
        self.wfile.write(b"0\r\n\r\n")


def _serve(handler: type[BaseHTTPRequestHandler]) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def proxy_to(fake: RunningServer) -> Iterator[Any]:
    servers: list[ThreadingHTTPServer] = []
    clients: list[KvHintClient] = []

    def start(upstream: str) -> tuple[Any, str]:
        client = KvHintClient(fake.address)
        clients.append(client)
        router = router_example.Router(client, {"idle_timeout_s": 600}, use_tiers=False)
        server = _serve(router_example.make_handler(router, urllib.parse.urlsplit(upstream)))
        servers.append(server)
        return router, f"127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
    for client in clients:
        client.close()


def _post(address: str, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes, float]:
    conn = http.client.HTTPConnection(address, timeout=30)
    started = time.monotonic()
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    first = resp.read1(65536) if resp.status == 200 else resp.read()
    first_at = time.monotonic() - started
    rest = resp.read()
    conn.close()
    return resp.status, first + rest, first_at


def test_an_engine_that_is_down_gets_a_502_and_the_session_is_not_left_running(proxy_to: Any) -> None:
    router, address = proxy_to(f"http://127.0.0.1:{_closed_port()}")
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    status, _, _ = _post(address, "/v1/chat/completions", body, {"X-Session-ID": "s3"})
    assert status == 502
    assert router.policy.sessions["s3"].state != "running"


def test_a_json_body_that_is_not_an_object_is_forwarded_not_a_dropped_connection(proxy_to: Any) -> None:
    _, address = proxy_to(f"http://127.0.0.1:{_closed_port()}")
    for body in (b"[]", b'"hello"', b"42"):
        status, _, _ = _post(address, "/v1/chat/completions", body)
        assert status == 502  # it reached the (absent) upstream instead of crashing the handler


def test_a_streamed_completion_on_any_path_is_forwarded_as_it_comes(proxy_to: Any) -> None:
    upstream = _serve(_Upstream)
    try:
        _, address = proxy_to(f"http://127.0.0.1:{upstream.server_address[1]}")
        status, data, first_at = _post(address, "/v1/completions", json.dumps({"prompt": "x", "stream": True}).encode())
        assert status == 200 and data.count(b"data: ") == 3
        assert first_at < 0.6, f"the first chunk arrived after {first_at:.1f}s: buffered"
    finally:
        upstream.shutdown()


def test_a_client_gone_mid_stream_still_ends_the_turn(proxy_to: Any) -> None:
    upstream = _serve(_Upstream)
    try:
        router, address = proxy_to(f"http://127.0.0.1:{upstream.server_address[1]}")
        body = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}).encode()
        conn = http.client.HTTPConnection(address, timeout=30)
        conn.request("POST", "/v1/chat/completions", body=body, headers={"X-Session-ID": "s4"})
        resp = conn.getresponse()
        resp.read1(100)
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and "s4" in router.adapter._streams:
            time.sleep(0.05)
        assert "s4" not in router.adapter._streams, "the stream's turn never ended"
    finally:
        upstream.shutdown()
