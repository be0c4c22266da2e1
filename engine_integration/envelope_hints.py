"""Lower a request's vLLM `KvHintsEnvelope` onto the KvHint executor.

vLLM 0.32 carries an orchestrator envelope on `Request.kv_hints` (offline
`add_request(kv_hints=...)`; Dynamo emits the same shape). When a request with
an envelope is added, its kvhint actions (`kv.pin`, `kv.retain`, ... see
kvhint_client.envelope) are applied on the engine thread right away, before
the request is scheduled, exactly like an ApplyHints batch: each gets one
result, published as a HintApplied event. Action types meant for other
consumers (e.g. Dynamo's `kv.fetch`) are skipped; a malformed envelope is
logged and ignored, and the request is served as usual.
"""

from __future__ import annotations

import logging
from typing import Any

from kvhint_client.envelope import EnvelopeError, envelope_to_hints
from kvhint_server.executor import HintExecutor
from kvhint_server.validation import parse_hints

log = logging.getLogger("kvhint.vllm")


def apply_request_envelope(executor: HintExecutor, request: Any) -> None:
    """Engine thread (from Scheduler.add_request)."""
    try:
        hints = envelope_to_hints(request.kv_hints, skip_unknown=True)
    except EnvelopeError as exc:
        log.warning("request %s: ignoring kv_hints envelope: %s", request.request_id, exc)
        return
    except Exception as exc:  # noqa: BLE001 - a payload the parser trips on (a null block hash): not EngineCore's end
        log.warning("request %s: ignoring malformed kv_hints envelope (%s: %s)", request.request_id, type(exc).__name__, exc)
        return
    if not hints:
        return
    core = executor.core
    try:
        executor.apply_batch(parse_hints(hints, core.config, core.info))
    except Exception:  # noqa: BLE001 - from Scheduler.add_request: an error here must not end EngineCore
        log.exception("request %s: applying its kv_hints envelope failed", request.request_id)
