"""Lifecycle signals from OpenAI chat-completions traffic, for routers that see nothing else.

A router (or proxy) calls, per request of a session:

    sid = adapter.on_request(body, headers)          # before forwarding
    adapter.on_response(sid, response_json)          # non-streaming answer
    # or, streaming:
    for chunk in sse_chunks: adapter.on_stream_chunk(sid, chunk)
    adapter.on_stream_end(sid)

and `adapter.tick()` on a timer. It feeds a `SessionPolicy`:

* a request of a session -> `RequestSent` (it ends the session's pause); a
  request naming a parent session (`X-Parent-Session-ID` header, or
  `vllm_xargs.parent_session_id`) that the adapter has not seen -> also
  `ChildSpawned(parent, child)`;
* a response whose `finish_reason` is ``"tool_calls"`` -> `ToolCallStarted`
  named by the tool(s) called (the pause lasts until the session's next
  request);
* any other finished response, or a request that failed (`on_error`) ->
  `RequestCompleted` (an idle pause);
* the session ends (`SessionEnded`) when a response's content contains
  `end_marker`, when it calls one of `end_tools`, or after `idle_timeout_s`
  without a request.

The session id comes from `session_of(body, headers)`. The default reads what
vLLM itself tags the request with (`engine_session_of`: the body's
``session_id``, then the `X-Session-ID` header, then
``vllm_xargs.session_id``), and falls back to the body's ``user``, which vLLM
does not read: a proxy then forwards the request with `X-Session-ID` set
(`upstream_headers`), so the engine tags it with the id the hints name.
Requests without one are ignored (None). `session_class_of(body, headers)`
gives the session's class, whose pauses are also learned together (default:
the `X-Session-Class` header). No agent-side change is needed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from .policy import SessionPolicy
from .signals import ChildSpawned, RequestCompleted, RequestSent, SessionEnded, ToolCallStarted

Body = Mapping[str, Any]
Headers = Mapping[str, str]


def _header(headers: Optional[Headers], name: str) -> Optional[str]:
    for key, value in (headers or {}).items():
        if key.lower() == name and value:
            return str(value)
    return None


def engine_session_of(body: Body, headers: Optional[Headers]) -> Optional[str]:
    """The session id vLLM 0.32 tags the request with, in its order: the body's ``session_id``,
    the `X-Session-ID` header, ``vllm_xargs.session_id`` (None: it tags none)."""
    value = body.get("session_id")
    if isinstance(value, str) and value:
        return value
    header = _header(headers, "x-session-id")
    if header is not None:
        return header
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, Mapping) and isinstance(xargs.get("session_id"), str) and xargs["session_id"]:
        return str(xargs["session_id"])
    return None


def default_session_of(body: Body, headers: Optional[Headers]) -> Optional[str]:
    """`engine_session_of`, else the body's ``user`` (see `upstream_headers`)."""
    sid = engine_session_of(body, headers)
    if sid is not None:
        return sid
    user = body.get("user")
    return user if isinstance(user, str) and user else None


def default_session_class_of(body: Body, headers: Optional[Headers]) -> Optional[str]:
    """The `X-Session-Class` header (a router's label of the agent's kind), else None."""
    return _header(headers, "x-session-class")


def upstream_headers(body: Body, headers: Headers, sid: Optional[str]) -> dict[str, str]:
    """The headers to forward a request with: `headers`, plus `X-Session-ID: sid` when the
    engine would not tag the request with `sid` itself (an id taken from ``user``, or from a
    custom `session_of`). Without it the engine's index never sees the session, and every
    hint for it comes back MISSING."""
    out = dict(headers)
    if sid is None or engine_session_of(body, headers) == sid:
        return out
    if engine_session_of(body, {}) is not None:
        raise ValueError(f"the request's body names session {engine_session_of(body, {})!r}, which vLLM reads "
                         f"before any header, and the router tracks it as {sid!r}")
    for key in [k for k in out if k.lower() == "x-session-id"]:
        del out[key]
    out["X-Session-ID"] = sid
    return out


def parent_of(body: Body, headers: Optional[Headers]) -> Optional[str]:
    """`X-Parent-Session-ID` header, else ``vllm_xargs.parent_session_id``."""
    header = _header(headers, "x-parent-session-id")
    if header is not None:
        return header
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, Mapping) and isinstance(xargs.get("parent_session_id"), str):
        return str(xargs["parent_session_id"])
    return None


def parse_sse_line(line: bytes | str) -> Optional[dict[str, Any]]:
    """One server-sent-events line -> its JSON chunk; None for blank lines, comments and ``[DONE]``."""
    text = line.decode("utf-8", "replace") if isinstance(line, bytes) else line
    text = text.strip()
    if not text.startswith("data:"):
        return None
    payload = text[5:].strip()
    if not payload or payload == "[DONE]":
        return None
    try:
        chunk = json.loads(payload)
    except ValueError:
        return None
    return chunk if isinstance(chunk, dict) else None


@dataclass
class _Stream:
    tools: dict[int, str] = field(default_factory=dict)  # tool-call index -> name
    content: list[str] = field(default_factory=list)
    finish_reason: Optional[str] = None


class OpenAITrafficAdapter:
    """See the module doc. Not thread-safe: a proxy serializes calls (one lock) around it."""

    def __init__(
        self,
        policy: SessionPolicy,
        *,
        idle_timeout_s: float = 600.0,
        end_marker: Optional[str] = None,
        end_tools: Iterable[str] = (),
        session_of: Callable[[Body, Optional[Headers]], Optional[str]] = default_session_of,
        session_class_of: Callable[[Body, Optional[Headers]], Optional[str]] = default_session_class_of,
        clock: Optional[Callable[[], float]] = None,
    ) -> None:
        self.policy = policy
        self.idle_timeout_s = idle_timeout_s
        self.end_marker = end_marker
        self.end_tools = frozenset(end_tools)
        self.session_of = session_of
        self.session_class_of = session_class_of
        self.clock = clock or policy.clock
        self.last_seen: dict[str, float] = {}
        self._streams: dict[str, _Stream] = {}

    def _now(self, t: Optional[float]) -> float:
        return self.clock() if t is None else t

    def on_request(self, body: Body, headers: Optional[Headers] = None, t: Optional[float] = None) -> Optional[str]:
        """A chat-completions request is about to be forwarded. Returns its session id (None: not tracked)."""
        sid = self.session_of(body, headers)
        if sid is None:
            return None
        now = self._now(t)
        parent = parent_of(body, headers)
        if parent is not None and sid not in self.last_seen:
            self.policy.observe(ChildSpawned(parent, sid, t=now))
        self.policy.observe(RequestSent(sid, session_class=self.session_class_of(body, headers), t=now))
        self.last_seen[sid] = now
        if parent is not None and parent in self.last_seen:
            # A parent waiting on its sub-agent is not idle: the idle timeout would end it (and
            # release the working child with it) while the child still runs.
            self.last_seen[parent] = now
        self._streams.pop(sid, None)
        return sid

    def on_response(self, sid: Optional[str], response: Body, t: Optional[float] = None) -> None:
        """A non-streaming chat-completions response."""
        if sid is None:
            return
        choices = response.get("choices") or [{}]
        message = choices[0].get("message") or {}
        tools = [c.get("function", {}).get("name", "") for c in message.get("tool_calls") or []]
        self._finished(sid, choices[0].get("finish_reason"), tools, message.get("content") or "", t)

    def on_stream_chunk(self, sid: Optional[str], chunk: Body) -> None:
        """One parsed SSE chunk (`parse_sse_line`) of a streaming response."""
        if sid is None:
            return
        stream = self._streams.setdefault(sid, _Stream())
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if delta.get("content"):
                stream.content.append(delta["content"])
            for call in delta.get("tool_calls") or []:
                name = (call.get("function") or {}).get("name")
                if name:
                    stream.tools[int(call.get("index", len(stream.tools)))] = name
            if choice.get("finish_reason"):
                stream.finish_reason = choice["finish_reason"]

    def on_stream_end(self, sid: Optional[str], t: Optional[float] = None) -> None:
        """The streaming response ended (after ``[DONE]`` or the connection closed)."""
        if sid is None:
            return
        stream = self._streams.pop(sid, _Stream())
        tools = [stream.tools[i] for i in sorted(stream.tools)]
        self._finished(sid, stream.finish_reason, tools, "".join(stream.content), t)

    def _finished(self, sid: str, finish_reason: Optional[str], tools: list[str], content: str, t: Optional[float]) -> None:
        now = self._now(t)
        self.last_seen[sid] = now
        ended = bool(self.end_marker and self.end_marker in content) or bool(tools and set(tools) <= self.end_tools)
        if ended:
            self.end(sid, now)
        elif finish_reason == "tool_calls" or tools:
            self.policy.observe(ToolCallStarted(sid, tools=tuple(t for t in tools if t), t=now))
        else:
            self.policy.observe(RequestCompleted(sid, t=now))

    def on_error(self, sid: Optional[str], t: Optional[float] = None) -> None:
        """The request failed (an HTTP error, or an error inside its stream): no tool call was
        made, so the session is idle, as after an answer."""
        if sid is None:
            return
        self._streams.pop(sid, None)
        self._finished(sid, None, [], "", t)

    def end(self, sid: str, t: Optional[float] = None) -> None:
        """End a session explicitly (e.g. the router saw its client disconnect)."""
        self.last_seen.pop(sid, None)
        self._streams.pop(sid, None)
        self.policy.observe(SessionEnded(sid, t=self._now(t)))

    def tick(self, t: Optional[float] = None) -> list[str]:
        """End sessions idle for `idle_timeout_s`. Returns the ones ended."""
        now = self._now(t)
        idle = [sid for sid, seen in self.last_seen.items() if now - seen >= self.idle_timeout_s]
        for sid in idle:
            self.end(sid, now)
        return idle


__all__ = [
    "OpenAITrafficAdapter",
    "default_session_class_of",
    "default_session_of",
    "engine_session_of",
    "parent_of",
    "parse_sse_line",
    "upstream_headers",
]
