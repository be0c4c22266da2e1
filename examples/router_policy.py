"""A chat-completions proxy that sends KvHint session hints for the traffic it forwards.

    # a served engine with the sidecar (see README), then:
    python examples/router_policy.py --upstream http://127.0.0.1:8000 --kvhint 127.0.0.1:50151 \
        --listen 127.0.0.1:8080 [--end-marker '<END>'] [--idle-timeout 600]
    # point agents at http://127.0.0.1:8080/v1 with an X-Session-ID header (or a "session_id" or
    # "user" field: a session named by "user" is forwarded with X-Session-ID, which vLLM reads)

    # or try it end to end: the proxy plus a few scripted agent turns through it
    python examples/router_policy.py --upstream http://127.0.0.1:8000 --kvhint 127.0.0.1:50151 --demo

Agents change nothing: the proxy forwards every request unchanged (streaming or not), and
`OpenAITrafficAdapter` turns what it sees into lifecycle signals for a `SessionPolicy`, which
sends Retain/Release (and Demote/Prefetch with tiers) through `KvHintClient`. A background
thread flushes the policy and ends idle sessions four times a second. Standard library only.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvhint.v1 import kvhint_pb2 as pb
from kvhint_client import KvHintClient
from kvhint_client.policy import ClientSink, OpenAITrafficAdapter, PolicyConfig, SessionPolicy, parse_sse_line, upstream_headers

HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "keep-alive"}


class Router:
    """The policy, its adapter and sink behind one lock (the proxy's threads share them)."""

    def __init__(self, client: KvHintClient, adapter_kw: dict[str, Any], use_tiers: bool) -> None:
        self.lock = threading.Lock()
        self.policy = SessionPolicy(PolicyConfig(use_tiers=use_tiers))
        self.policy.configure(client.capabilities(timeout=5))
        self.adapter = OpenAITrafficAdapter(self.policy, **adapter_kw)
        self.sink = ClientSink(client)
        self.log: list[str] = []

    def flush(self) -> None:
        with self.lock:
            self.adapter.tick()
            for hint, result in self.policy.flush(self.sink):
                target = hint.selector.session.session_id or hint.selector.continuation.continuation_id
                line = f"{hint.WhichOneof('action')} {target} -> {pb.Outcome.Name(result.outcome)}"
                self.log.append(line)
                print("kvhint:", line, file=sys.stderr)

    def run_flusher(self, stop: threading.Event, period_s: float = 0.25) -> None:
        while not stop.wait(period_s):
            try:
                self.flush()
            except Exception as exc:  # the engine may be restarting; keep proxying
                print(f"kvhint: flush failed: {exc}", file=sys.stderr)


def make_handler(router: Router, upstream: urllib.parse.SplitResult) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            self._forward(None)

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self._forward(body)

        def _forward(self, body: bytes | None) -> None:
            sid = None
            payload: dict[str, Any] = {}
            if body and self.path.rstrip("/").endswith("/chat/completions"):
                try:
                    payload = json.loads(body)
                except ValueError:
                    payload = {}
                if not isinstance(payload, dict):  # a JSON array or string: the engine answers 400
                    payload = {}
                with router.lock:
                    sid = router.adapter.on_request(payload, dict(self.headers.items()))
            conn = http.client.HTTPConnection(upstream.hostname, upstream.port or 80, timeout=600)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
            # The engine must tag the request with the id the hints name (an id from "user" is not).
            headers = upstream_headers(payload, headers, sid)
            try:
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
            except OSError as exc:  # the engine is down or restarting: 502, and the session is idle
                conn.close()
                if sid is not None:
                    with router.lock:
                        router.adapter.on_error(sid)
                self.send_error(502, f"upstream: {exc}")
                router.flush()
                return
            self.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in HOP_HEADERS:
                    self.send_header(k, v)
            # Streamed whatever the path (completions too): the upstream says so.
            if (resp.getheader("Content-Type") or "").startswith("text/event-stream"):
                try:
                    self._stream(resp, sid)
                finally:
                    conn.close()
                router.flush()
                return
            data = resp.read()
            conn.close()
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            try:
                self.wfile.write(data)
            except OSError:  # the client went away; the engine answered all the same
                pass
            if sid is not None:
                try:
                    answer = json.loads(data) if resp.status == 200 else None
                except ValueError:
                    answer = None
                with router.lock:
                    if isinstance(answer, dict):
                        router.adapter.on_response(sid, answer)
                    else:  # failed: the session is idle, not running until the idle timeout
                        router.adapter.on_error(sid)
            router.flush()

        def _stream(self, resp: http.client.HTTPResponse, sid: str | None) -> None:
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            try:
                for line in iter(resp.readline, b""):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                    chunk = parse_sse_line(line)
                    if chunk is not None and sid is not None:
                        with router.lock:
                            router.adapter.on_stream_chunk(sid, chunk)
                self.wfile.write(b"0\r\n\r\n")
            except OSError:  # the client went away mid-stream: the turn still ends here
                pass
            finally:
                if sid is not None:
                    with router.lock:
                        router.adapter.on_stream_end(sid)

    return Handler


def _cached(data: bytes, stream: bool) -> str:
    """The prompt tokens the engine served from its prefix cache, as its usage reports them
    (vLLM reports them with --enable-prompt-tokens-details)."""
    usage: Any = None
    try:
        if stream:
            chunks = [parse_sse_line(line) for line in data.splitlines()]
            usage = next((c["usage"] for c in reversed(chunks) if c and c.get("usage")), None)
        else:
            usage = json.loads(data).get("usage")
    except (ValueError, AttributeError):
        usage = None
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None:
        return "cached tokens not reported (serve with --enable-prompt-tokens-details)"
    return f"{cached} of {usage.get('prompt_tokens')} prompt tokens cached"


def demo(listen: str, model: str | None, turns: int) -> None:
    """Two scripted agents, one streaming, talking through the proxy. Each keeps its conversation
    and sends it whole every turn, as agents do, so a turn reuses the session's cached prefix."""
    host, port = listen.rsplit(":", 1)
    if model is None:
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("GET", "/v1/models")
        model = json.loads(conn.getresponse().read())["data"][0]["id"]
        conn.close()
    agents = {sid: [{"role": "system", "content": f"You are {sid}. " + "context " * 100}]
              for sid in ("demo-agent-a", "demo-agent-b")}
    for turn in range(turns):
        for sid, stream in (("demo-agent-a", False), ("demo-agent-b", True)):
            messages = agents[sid]
            messages.append({"role": "user", "content": f"turn {turn}: go on"})
            conn = http.client.HTTPConnection(host, int(port), timeout=120)
            body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": 8, "stream": stream}
            if stream:
                body["stream_options"] = {"include_usage": True}
            conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json", "X-Session-ID": sid})
            resp = conn.getresponse()
            data = resp.read()
            print(f"demo: {sid} turn {turn}: {_cached(data, stream)}, HTTP {resp.status}", file=sys.stderr)
            conn.close()
            messages.append({"role": "assistant", "content": f"done with turn {turn}"})
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--upstream", required=True, help="the engine's OpenAI base URL, e.g. http://127.0.0.1:8000")
    ap.add_argument("--kvhint", required=True, help="the engine's KvHint gRPC address")
    ap.add_argument("--listen", default="127.0.0.1:8080")
    ap.add_argument("--end-marker", default=None, help="assistant text that ends a session")
    ap.add_argument("--end-tool", action="append", default=[], help="a tool whose call ends the session")
    ap.add_argument("--idle-timeout", type=float, default=600.0, help="seconds without a request that end a session")
    ap.add_argument("--tiers", action="store_true", help="Demote/Prefetch long pauses (engine started with tiers)")
    ap.add_argument("--demo", action="store_true", help="send a few scripted turns through the proxy, then exit")
    ap.add_argument("--model", default=None, help="model name for --demo (default: the engine's)")
    a = ap.parse_args(argv)
    upstream = urllib.parse.urlsplit(a.upstream)
    with KvHintClient(a.kvhint) as client:
        kw = {"idle_timeout_s": a.idle_timeout, "end_marker": a.end_marker, "end_tools": a.end_tool}
        router = Router(client, kw, a.tiers)
        host, port = a.listen.rsplit(":", 1)
        server = ThreadingHTTPServer((host, int(port)), make_handler(router, upstream))
        stop = threading.Event()
        threads = [threading.Thread(target=server.serve_forever, daemon=True),
                   threading.Thread(target=router.run_flusher, args=(stop,), daemon=True)]
        for t in threads:
            t.start()
        print(f"proxying http://{a.listen} -> {a.upstream}, hints to {a.kvhint}", file=sys.stderr)
        try:
            if a.demo:
                demo(a.listen, a.model, turns=3)
                with router.lock:
                    for sid in list(router.adapter.last_seen):
                        router.adapter.end(sid)
                router.flush()
                print(json.dumps({"hints": router.log, "stats": router.policy.stats}, indent=2))
            else:
                threading.Event().wait()
        except KeyboardInterrupt:
            pass
        finally:
            stop.set()
            server.shutdown()
            server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
