"""`openai_traffic.complete` against a loopback HTTP server that streams what vLLM's OpenAI
server sends: a failure after the 200 header (vLLM's engine dying mid-request) is an error,
not an empty completion with 0 cached tokens, and so is a chunk that is not JSON."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from http_stub import QuietHandler, serving

from kvhint_client.openai_traffic import CompletionError, complete

TOKEN = {"choices": [{"index": 0, "text": "a", "token_ids": [7], "finish_reason": None}]}
USAGE = {"choices": [], "usage": {"prompt_tokens": 64, "completion_tokens": 1,
                                   "prompt_tokens_details": {"cached_tokens": 32}}}
STREAMS: dict[str, list[object]] = {
    "ok": [TOKEN, USAGE, "[DONE]"],
    "error-chunk": [{"error": {"message": "EngineCore encountered an issue.", "type": "InternalServerError", "code": 500}}, "[DONE]"],
    "old-error-chunk": [{"object": "error", "message": "bad", "type": "BadRequestError", "code": 400}, "[DONE]"],
    "error-no-code": [TOKEN, {"error": {"message": "lost"}}],
    "cut-short": [TOKEN],
    "not-json": [TOKEN, "{truncated", "[DONE]"],
    "not-an-object": [TOKEN, "[1, 2]", "[DONE]"],
}


class _Handler(QuietHandler):
    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for item in STREAMS[self.headers["X-Stream"]]:
            payload = item if isinstance(item, str) else json.dumps(item)
            self.wfile.write(f"data: {payload}\n\n".encode())
        self.wfile.flush()


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with serving(_Handler) as url:
        yield url


def test_a_complete_stream_gives_its_tokens_and_cached_tokens(base_url: str) -> None:
    done = complete(base_url, [1, 2, 3], extra_headers={"X-Stream": "ok"})
    assert done.token_ids == (7,) and done.cached_tokens == 32 and done.prompt_tokens == 64


@pytest.mark.parametrize("stream,status", [("error-chunk", 500), ("old-error-chunk", 400), ("error-no-code", 500)])
def test_an_error_chunk_raises_with_its_code(base_url: str, stream: str, status: int) -> None:
    with pytest.raises(CompletionError) as failed:
        complete(base_url, [1, 2, 3], extra_headers={"X-Stream": stream})
    assert failed.value.status == status
    assert "error" in failed.value.body


def test_a_stream_cut_short_raises(base_url: str) -> None:
    with pytest.raises(CompletionError, match=r"ended without \[DONE\]") as failed:
        complete(base_url, [1, 2, 3], extra_headers={"X-Stream": "cut-short"})
    assert failed.value.status == 200


@pytest.mark.parametrize("stream", ["not-json", "not-an-object"])
def test_a_chunk_that_is_not_a_json_object_raises(base_url: str, stream: str) -> None:
    with pytest.raises(CompletionError, match="not a completions stream chunk") as failed:
        complete(base_url, [1, 2, 3], extra_headers={"X-Stream": stream})
    assert failed.value.status == 200
