"""Drive an OpenAI-compatible /v1/completions endpoint with session coordinates.

Used by the demo, the benchmarks and the conformance suite: each request
carries the session in the `X-Session-ID` header and the continuation (and
parent session) in `vllm_xargs`, so nothing engine-internal is needed. The
response reports `usage.prompt_tokens_details.cached_tokens` (vLLM needs
`--enable-prompt-tokens-details`), and streaming gives the client-side TTFT.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Completion:
    prompt_tokens: int
    cached_tokens: int
    token_ids: tuple[int, ...]
    text: str
    ttft_s: float
    latency_s: float
    #: Per generated token, the top candidates' logprobs, highest first (empty unless the
    #: request asked for them: `extra_body={"logprobs": k}`).
    top_logprobs: tuple[tuple[float, ...], ...] = ()
    #: The token ids of those candidates, in the same order, when the request also asked for
    #: vLLM's `"return_tokens_as_token_ids": True` (keys "token_id:N"); -1 where a key is a
    #: token's text.
    top_token_ids: tuple[tuple[int, ...], ...] = ()


class CompletionError(RuntimeError):
    """A completion that did not complete: an HTTP error status, an error chunk inside the
    stream (`status`: its code), or a stream that ended before `[DONE]` or carried a chunk that
    is not a JSON object (`status`: the response's, 200)."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body


def complete(
    base_url: str,
    prompt: list[int] | str,
    *,
    model: str | None = None,
    session_id: str | None = None,
    continuation_id: str | None = None,
    parent_session_id: str | None = None,
    max_tokens: int = 1,
    timeout: float = 120.0,
    extra_body: dict[str, object] | None = None,
    extra_headers: dict[str, str] | None = None,
) -> Completion:
    """One greedy completion, streamed so TTFT is measured at the client.

    `extra_body` adds vLLM sampling fields to the request body (for example
    `{"ignore_eos": True}`, which trace replays need so every request produces
    exactly `max_tokens` tokens). `extra_headers` adds HTTP headers (for example
    vLLM's `X-data-parallel-rank`, which sends the request to one DP rank)."""
    body: dict[str, object] = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    if model:
        body["model"] = model
    if extra_body:
        body.update(extra_body)
    xargs = {k: v for k, v in (("continuation_id", continuation_id), ("parent_session_id", parent_session_id)) if v}
    if xargs:
        body["vllm_xargs"] = xargs
    headers = {"Content-Type": "application/json"}
    if session_id:
        headers["X-Session-ID"] = session_id
    headers.update(extra_headers or {})
    req = urllib.request.Request(base_url.rstrip("/") + "/v1/completions", json.dumps(body).encode(), headers)
    start = time.perf_counter()
    ttft = None
    text: list[str] = []
    tokens: list[int] = []
    top: list[tuple[float, ...]] = []
    top_ids: list[tuple[int, ...]] = []
    usage: dict[str, Any] = {}
    done = False
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                try:
                    chunk = json.loads(data)
                except ValueError:
                    chunk = None
                if not isinstance(chunk, dict):
                    raise CompletionError(resp.status, f"not a completions stream chunk: {data[:300]}")
                failed = _stream_error(chunk)
                if failed is not None:
                    # The server failed after the 200 header went out (vLLM: the engine died
                    # mid-request): the error arrives as a chunk of the stream.
                    raise CompletionError(failed, data)
                for choice in chunk.get("choices") or []:
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    text.append(choice.get("text") or "")
                    tokens.extend(choice.get("token_ids") or [])
                    for step in (choice.get("logprobs") or {}).get("top_logprobs") or []:
                        ranked = sorted((step or {}).items(), key=lambda kv: kv[1], reverse=True)
                        top.append(tuple(lp for _, lp in ranked))
                        top_ids.append(tuple(_token_id(key) for key, _ in ranked))
                if chunk.get("usage"):
                    usage = chunk["usage"]
            if not done:
                raise CompletionError(resp.status, "the stream ended without [DONE]: the server closed it mid-response")
    except urllib.error.HTTPError as err:
        raise CompletionError(err.code, err.read().decode(errors="replace")) from err
    latency = time.perf_counter() - start
    details = usage.get("prompt_tokens_details") or {}
    return Completion(
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        cached_tokens=int(details.get("cached_tokens", 0) or 0),
        token_ids=tuple(tokens),
        text="".join(text),
        ttft_s=ttft if ttft is not None else latency,
        latency_s=latency,
        top_logprobs=tuple(top),
        top_token_ids=tuple(top_ids),
    )


def complete_batch(
    base_url: str,
    prompts: list[list[int]],
    *,
    model: str | None = None,
    max_tokens: int = 1,
    timeout: float = 120.0,
    extra_headers: dict[str, str] | None = None,
) -> list[str]:
    """Greedy completions of several prompts in one request (the completions API's list of
    prompts), not streamed. The server hands all of them to its engine at once, so a caller
    that needs them in the engine at the same time does not depend on the timing of its own
    threads. Returns each prompt's text, in prompt order.

    Raises CompletionError for an HTTP error status, or (status 200) when the response does
    not hold exactly one choice per prompt."""
    body: dict[str, object] = {"prompt": prompts, "max_tokens": max_tokens, "temperature": 0.0}
    if model:
        body["model"] = model
    headers = {"Content-Type": "application/json"}
    headers.update(extra_headers or {})
    req = urllib.request.Request(base_url.rstrip("/") + "/v1/completions", json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read().decode(errors="replace")
            status = resp.status
    except urllib.error.HTTPError as err:
        raise CompletionError(err.code, err.read().decode(errors="replace")) from err
    try:
        choices = json.loads(raw).get("choices") or []
        texts = {int(c["index"]): str(c.get("text") or "") for c in choices}
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise CompletionError(status, f"not a completions response ({exc}): {raw[:300]}") from exc
    if len(choices) != len(prompts) or sorted(texts) != list(range(len(prompts))):
        raise CompletionError(
            status, f"{len(choices)} choices (indexes {sorted(texts)}) for {len(prompts)} prompts: {raw[:300]}"
        )
    return [texts[i] for i in range(len(prompts))]


def _stream_error(chunk: dict[str, object]) -> int | None:
    """The status of an error a streamed chunk reports, None for a normal chunk: vLLM's
    `{"error": {"code": ...}}` or the older `{"object": "error", "code": ...}` (500 when the
    chunk names no integer code)."""
    error = chunk.get("error")
    if isinstance(error, dict):
        code = error.get("code")
    elif chunk.get("object") == "error":
        code = chunk.get("code")
    else:
        return None
    return code if isinstance(code, int) and not isinstance(code, bool) else 500


def _token_id(key: str) -> int:
    """The id in a logprobs key written as vLLM's "token_id:N"; -1 for a token's text."""
    head, _, tail = key.partition(":")
    return int(tail) if head == "token_id" and tail.isdigit() else -1


def first_model(base_url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(base_url.rstrip("/") + "/v1/models", timeout=timeout) as resp:
        return json.load(resp)["data"][0]["id"]
