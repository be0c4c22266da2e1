"""`openai_traffic.complete_batch` against a loopback HTTP server: one request carries every
prompt, the texts come back in prompt order whatever order the choices arrive in, and a
response without one choice per prompt, or an error status, raises instead of returning
fewer texts."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from http_stub import QuietHandler, serving

from kvhint_client.openai_traffic import CompletionError, complete_batch

BODIES: list[dict[str, object]] = []


class _Handler(QuietHandler):
    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        BODIES.append(body)
        mode = self.headers["X-Mode"]
        if mode == "status":
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b'{"error": "prompt must be a string"}')
            return
        n = len(body["prompt"])
        choices = [{"index": i, "text": f"t{i}"} for i in reversed(range(n))]
        if mode == "short":
            choices = choices[1:]
        payload = b"not json" if mode == "garbage" else json.dumps({"choices": choices}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(payload)


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with serving(_Handler) as url:
        yield url


def test_one_request_carries_every_prompt_and_texts_come_back_in_prompt_order(base_url: str) -> None:
    BODIES.clear()
    texts = complete_batch(base_url, [[1, 2], [3], [4, 5, 6]], model="m", max_tokens=16, extra_headers={"X-Mode": "ok"})
    assert texts == ["t0", "t1", "t2"]
    assert len(BODIES) == 1
    assert BODIES[0]["prompt"] == [[1, 2], [3], [4, 5, 6]]
    assert BODIES[0]["max_tokens"] == 16 and BODIES[0]["model"] == "m" and BODIES[0]["temperature"] == 0.0


@pytest.mark.parametrize("mode,status,match", [
    ("short", 200, "2 choices .* for 3 prompts"),
    ("garbage", 200, "not a completions response"),
    ("status", 400, "must be a string"),
])
def test_a_response_without_every_prompt_raises(base_url: str, mode: str, status: int, match: str) -> None:
    with pytest.raises(CompletionError, match=match) as failed:
        complete_batch(base_url, [[1], [2], [3]], extra_headers={"X-Mode": mode})
    assert failed.value.status == status
