"""Session coordinates of a vLLM request.

* session_id: vLLM's own `Request.session_id` (body field `session_id`, the
  `X-Session-ID` header, or the offline `add_request(session_id=...)`).
* continuation_id / parent_session_id: the request's extra args, i.e. the
  OpenAI body field `vllm_xargs: {"continuation_id": ..., "parent_session_id": ...}`
  or `SamplingParams(extra_args=...)`.

Coordinates are validated for shape only (a non-empty string of at most
`max_len` bytes); a malformed one is ignored (the request is still served,
exactly as stock vLLM would) and logged once per request.
"""

from __future__ import annotations

import logging
from typing import Any

from kvhint_server.model import RequestCoords

log = logging.getLogger("kvhint.coords")

CONTINUATION_KEY = "continuation_id"
PARENT_SESSION_KEY = "parent_session_id"
_ATTR = "_kvhint_coords"
NO_COORDS = RequestCoords()


def _valid(value: Any, what: str, request_id: str, max_len: int) -> str | None:
    if value is None:
        return None
    if isinstance(value, str) and value:
        try:
            if len(value.encode("utf-8")) <= max_len:
                return value
        except UnicodeEncodeError:  # a lone surrogate: not text the proto can carry
            pass
    log.warning("request %s: ignoring malformed %s %r (want 1..%d bytes of text)", request_id, what, value, max_len)
    return None


def request_coords(request: Any, max_len: int = 256) -> RequestCoords:
    """The request's coordinates, computed once and cached on the request."""
    cached = getattr(request, _ATTR, None)
    if cached is not None:
        return cached
    rid = getattr(request, "request_id", "?")
    session = _valid(getattr(request, "session_id", None), "session_id", rid, max_len)
    params = getattr(request, "sampling_params", None)
    extra = getattr(params, "extra_args", None) or {}
    continuation = _valid(extra.get(CONTINUATION_KEY), CONTINUATION_KEY, rid, max_len)
    parent = _valid(extra.get(PARENT_SESSION_KEY), PARENT_SESSION_KEY, rid, max_len)
    coords = RequestCoords(session, continuation, parent) if (session or continuation) else NO_COORDS
    try:
        setattr(request, _ATTR, coords)
    except AttributeError:
        pass
    return coords


def forget_request_coords(request: Any) -> None:
    """Drop the coordinates cached on `request` (its sampling params were replaced: the next
    chunk of a streaming-input request may name another continuation)."""
    try:
        delattr(request, _ATTR)
    except AttributeError:
        pass
