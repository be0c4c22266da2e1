"""A fake OpenAI-compatible /v1/completions endpoint over the unit tests' fake engine
(tests/unit/kvhint_unit_support.FakeEngine), so the conformance cases that need traffic (but not
pressure: the fake engine never evicts) run without vLLM.

A token-id prompt's full blocks are hashed as a chain; the leading blocks already on the device
are a prefix hit (`usage.prompt_tokens_details.cached_tokens`), the rest are stored, all with the
request's session coordinates (the X-Session-ID header, vllm_xargs continuation_id and
parent_session_id). Every completion is one token."""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from collections.abc import Iterator
from typing import Any

from http_stub import QuietHandler, serving  # tests/client (the caller puts it on sys.path)


def _chain(prompt: list[int], block_size: int) -> list[bytes]:
    hashes: list[bytes] = []
    parent = b""
    for start in range(0, len(prompt) - block_size + 1, block_size):
        block = b"".join(t.to_bytes(4, "big") for t in prompt[start : start + block_size])
        parent = hashlib.sha256(parent + block).digest()
        hashes.append(parent)
    return hashes


@contextlib.contextmanager
def openai_over(engine: Any) -> Iterator[str]:
    """Serve the fake endpoint over `engine` (a FakeEngine); yields its base URL."""
    block_size = engine.info().block_size
    lock = threading.Lock()

    class Handler(QuietHandler):
        def _send(self, body: bytes, content_type: str = "application/json") -> None:
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self._send(json.dumps({"data": [{"id": "fake"}]}).encode())

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            prompt = body["prompt"]
            xargs = body.get("vllm_xargs") or {}
            coords = {"session": self.headers.get("X-Session-ID"), "continuation": xargs.get("continuation_id"),
                      "parent_session": xargs.get("parent_session_id")}
            hashes = _chain(prompt, block_size)
            with lock:  # one request at a time, as one engine step
                hit = 0
                while hit < len(hashes) and hashes[hit] in engine.device:
                    hit += 1
                if hit:
                    engine.store(hashes[:hit], prefix_hit=True, **coords)
                if hit < len(hashes):
                    engine.store(hashes[hit:], first_position=hit, parent=hashes[hit - 1] if hit else None, **coords)
            usage = {"prompt_tokens": len(prompt), "completion_tokens": 1,
                     "prompt_tokens_details": {"cached_tokens": hit * block_size}}
            chunks = [{"choices": [{"index": 0, "text": "x", "token_ids": [7]}]}, {"choices": [], "usage": usage}]
            self._send(b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n",
                       "text/event-stream")

    with serving(Handler) as url:
        yield url
