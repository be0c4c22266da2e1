"""Request building, response parsing and retry bookkeeping shared by the sync and asyncio
clients, so both expose the same behaviour with only the I/O differing."""

from __future__ import annotations

import datetime as _dt
import random
import secrets
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Optional, Union

import grpc
from grpc_health.v1 import health_pb2

from kvhint.v1 import kvhint_pb2

from .builders import SelectorLike, as_selector
from .config import MAX_TIMEOUT_S, ConnectionConfig, RetryPolicy, check_timeout
from .durations import Seconds, to_duration
from .errors import KvHintError
from .names import TierLike, parse_tier
from .results import ApplyResult, Residency

SERVICE_NAME = "kvhint.v1.KvHintService"
#: Services health() checks: the KvHint service and the server as a whole.
HEALTH_SERVICES = (SERVICE_NAME, "")

StartLike = Union[int, str, None]
_START_NAMES = {
    "now": kvhint_pb2.WatchEventsRequest.START_NOW,
    "snapshot": kvhint_pb2.WatchEventsRequest.START_SNAPSHOT,
    "resume": kvhint_pb2.WatchEventsRequest.START_RESUME,
}
_FINAL_OPERATION_STATES = (kvhint_pb2.Operation.STATE_SUCCEEDED, kvhint_pb2.Operation.STATE_FAILED)


# -- retries -------------------------------------------------------------------------------------


class Attempts:
    """Deadline and retry bookkeeping for one unary call.

    The overall deadline (timeout) spans every attempt; each attempt gets the time left.
    """

    def __init__(self, policy: RetryPolicy, timeout: Optional[float], rng: Optional[random.Random] = None) -> None:
        self._policy = policy
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._rng = rng
        self.count = 0

    def attempt_timeout(self) -> Optional[float]:
        """Start an attempt; the time it may take (None: no deadline)."""
        self.count += 1
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - time.monotonic())

    def retry_delay(self, code: grpc.StatusCode, retry_after: Optional[float] = None) -> Optional[float]:
        """Seconds to wait before retrying after a failure with `code` (and the server's
        RetryInfo delay, if any); None: do not retry."""
        if self.count >= self._policy.max_attempts:
            return None
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            policy = self._policy
            if not policy.retry_resource_exhausted or retry_after is None or retry_after > policy.max_retry_after:
                return None
            delay = retry_after
        elif self._policy.retryable(code):
            delay = self._policy.backoff(self.count, self._rng)
        else:
            return None
        if self._deadline is not None and time.monotonic() + delay >= self._deadline:
            return None
        return delay


def resolve_timeout(config: ConnectionConfig, timeout: Optional[float]) -> Optional[float]:
    """Per-call override (checked: config.check_timeout), else the config default."""
    if timeout is not None:
        return check_timeout(timeout, "timeout")
    return config.default_timeout


def stream_timeout(timeout: Optional[float]) -> Optional[float]:
    """A stream's deadline: None (none), or checked as every timeout is (config.check_timeout)."""
    return None if timeout is None else check_timeout(timeout, "timeout")


def poll_timeout(config: ConnectionConfig, remaining: float) -> float:
    """The timeout of one GetOperation poll of a wait with `remaining` seconds left (possibly inf):
    the config default, within what is left and MAX_TIMEOUT_S."""
    return min(remaining, config.default_timeout or MAX_TIMEOUT_S, MAX_TIMEOUT_S)


def retry_after_of(error: grpc.RpcError) -> Optional[float]:
    """The RetryInfo delay a RESOURCE_EXHAUSTED error carries (None otherwise)."""
    if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    return KvHintError.from_rpc_error(error).retry_after


def rpc_error(error: grpc.RpcError, method: str, address: str) -> KvHintError:
    return KvHintError.from_rpc_error(error, method=method, address=address)


# -- requests -----------------------------------------------------------------------------------


def new_hint_id(max_length: int = 0) -> str:
    """A fresh hint id: a uuid4, or, when the server takes shorter ids (limits.max_hint_id_length
    under 36 bytes), `max_length` characters of random URL-safe text (6 random bits each)."""
    hint_id = str(uuid.uuid4())
    if max_length and len(hint_id) > max_length:
        hint_id = secrets.token_urlsafe(max_length)[:max_length]
    return hint_id


def prepare_hints(hints: Iterable[kvhint_pb2.Hint], limits: Optional[kvhint_pb2.Limits] = None) -> list[kvhint_pb2.Hint]:
    """Copies of `hints`, each without a hint_id given a fresh one (new_hint_id, within the server's
    max_hint_id_length once its limits are known), so retries are idempotent."""
    max_length = limits.max_hint_id_length if limits is not None else 0
    prepared = []
    for hint in hints:
        if not isinstance(hint, kvhint_pb2.Hint):
            raise ValueError(f"apply() takes kvhint_pb2.Hint values (see kvhint_client.builders), got {type(hint).__name__}")
        copy = kvhint_pb2.Hint()
        copy.CopyFrom(hint)
        if not copy.hint_id:
            copy.hint_id = new_hint_id(max_length)
        prepared.append(copy)
    if not prepared:
        raise ValueError("apply() needs at least one hint")
    return prepared


def check_limits(hints: Sequence[kvhint_pb2.Hint], limits: Optional[kvhint_pb2.Limits]) -> None:
    """Check a batch against the server's GetCapabilities limits before sending it
    (ValueError naming the field); nothing to check before the limits are known."""
    if limits is None:
        return
    if limits.max_hints_per_batch and len(hints) > limits.max_hints_per_batch:
        raise ValueError(f"{len(hints)} hints; the server takes at most {limits.max_hints_per_batch} per batch "
                         "(GetCapabilities limits.max_hints_per_batch)")
    hashes = 0
    for i, hint in enumerate(hints):
        if not isinstance(hint, kvhint_pb2.Hint):
            return  # prepare_hints says what is wrong
        ids = [("hint_id", hint.hint_id, limits.max_hint_id_length)]
        target = hint.selector.WhichOneof("target")
        if target == "session":
            ids.append(("selector.session.session_id", hint.selector.session.session_id, limits.max_id_length))
        elif target == "continuation":
            ids.append(("selector.continuation.continuation_id", hint.selector.continuation.continuation_id, limits.max_id_length))
        elif target == "block_hashes":
            n = len(hint.selector.block_hashes.block_hashes)
            if limits.max_block_hashes_per_selector and n > limits.max_block_hashes_per_selector:
                raise ValueError(f"hints[{i}].selector.block_hashes has {n} hashes; the server takes at most "
                                 f"{limits.max_block_hashes_per_selector} (GetCapabilities limits.max_block_hashes_per_selector)")
            hashes += n
            if limits.max_block_hashes_per_batch and hashes > limits.max_block_hashes_per_batch:
                raise ValueError(f"hints[:{i + 1}] hold {hashes} block hashes; the server takes at most "
                                 f"{limits.max_block_hashes_per_batch} per batch (GetCapabilities "
                                 "limits.max_block_hashes_per_batch): split the batch")
        if hint.WhichOneof("action") == "share":
            ids.append(("share.destination", hint.share.destination, limits.max_id_length))
        for path, value, most in ids:
            size = len(value.encode("utf-8"))
            if most and size > most:
                raise ValueError(f"hints[{i}].{path} is {size} bytes; the server accepts at most {most} "
                                 "(GetCapabilities limits)")


def apply_result(hints: list[kvhint_pb2.Hint], response: kvhint_pb2.ApplyHintsResponse, address: str) -> ApplyResult:
    if len(response.results) != len(hints):
        raise KvHintError(
            grpc.StatusCode.INTERNAL,
            f"server returned {len(response.results)} results for {len(hints)} hints",
            method="ApplyHints",
            address=address,
        )
    return ApplyResult(
        hints=hints,
        results=list(response.results),
        epoch=response.epoch,
        applied_at_sequence=response.applied_at_sequence,
        deferred_steps=response.deferred_steps,
    )


def query_request(
    selector: SelectorLike, tiers: Iterable[TierLike], page_size: int, page_token: str
) -> kvhint_pb2.QueryResidencyRequest:
    return kvhint_pb2.QueryResidencyRequest(
        selector=as_selector(selector),
        tiers=[parse_tier(t) for t in tiers],
        page_size=page_size,
        page_token=page_token,
    )


def sessions_request(prefix: str, page_size: int, page_token: str) -> kvhint_pb2.ListSessionsRequest:
    return kvhint_pb2.ListSessionsRequest(session_id_prefix=prefix, page_size=page_size, page_token=page_token)


def watch_request(
    start: StartLike,
    resume: Optional[tuple[str, int]],
    filter: Optional[kvhint_pb2.EventFilter],
    heartbeat: Optional[Union[Seconds, _dt.timedelta]],
) -> kvhint_pb2.WatchEventsRequest:
    """Start defaults to RESUME when `resume=(epoch, last_sequence)` is given, else NOW."""
    if start is None:
        start_value = kvhint_pb2.WatchEventsRequest.START_RESUME if resume else kvhint_pb2.WatchEventsRequest.START_NOW
    elif isinstance(start, str):
        if start.lower() not in _START_NAMES:
            raise ValueError(f"unknown start {start!r}; choose one of {sorted(_START_NAMES)}")
        start_value = _START_NAMES[start.lower()]
    else:
        start_value = kvhint_pb2.WatchEventsRequest.Start.ValueType(start)
    request = kvhint_pb2.WatchEventsRequest(start=start_value)
    if start_value == kvhint_pb2.WatchEventsRequest.START_RESUME:
        if not resume or not resume[0]:
            raise ValueError("start=resume needs resume=(epoch, last_sequence)")
        request.resume_epoch, request.resume_after_sequence = resume[0], int(resume[1])
    elif resume:
        raise ValueError("resume=(epoch, sequence) is only valid with start=resume")
    if filter is not None:
        request.filter.CopyFrom(filter)
    if heartbeat is not None:
        request.heartbeat_interval.CopyFrom(to_duration(heartbeat, name="heartbeat"))
    return request


# -- pagination ---------------------------------------------------------------------------------


class PageTokens:
    """Follows next_page_token; refuses a token the server already gave (a loop)."""

    def __init__(self, method: str, address: str) -> None:
        self._seen: set[str] = set()
        self._method, self._address = method, address
        self.token = ""

    def advance(self, next_token: str) -> bool:
        """Record the next token; False when there are no more pages."""
        if not next_token:
            return False
        if next_token in self._seen:
            raise KvHintError(
                grpc.StatusCode.INTERNAL, f"server repeated page token {next_token!r}", method=self._method, address=self._address
            )
        self._seen.add(next_token)
        self.token = next_token
        return True


class ResidencyPages:
    """Accumulates QueryResidency pages into a Residency."""

    def __init__(self) -> None:
        self.blocks: list[kvhint_pb2.BlockInfo] = []
        self.last: Optional[kvhint_pb2.QueryResidencyResponse] = None
        self.pages = 0

    def add(self, page: kvhint_pb2.QueryResidencyResponse) -> None:
        self.blocks.extend(page.blocks)
        self.last = page
        self.pages += 1

    def result(self) -> Residency:
        last = self.last or kvhint_pb2.QueryResidencyResponse()
        return Residency(
            blocks=self.blocks,
            totals={t.tier: t.blocks for t in last.totals},
            as_of_epoch=last.as_of_epoch,
            as_of_sequence=last.as_of_sequence,
            pages=self.pages,
        )


# -- operations and health ------------------------------------------------------------------------


def operation_finished(operation: kvhint_pb2.Operation) -> bool:
    return operation.state in _FINAL_OPERATION_STATES


def operation_timeout_error(operation_id: str, last: Optional[kvhint_pb2.Operation], timeout: float, address: str) -> KvHintError:
    state = kvhint_pb2.Operation.State.Name(last.state) if last is not None else "unknown"
    return KvHintError(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        f"operation {operation_id} not finished after {timeout:g}s (last state {state})",
        method="GetOperation",
        address=address,
    )


def health_status_name(status: int) -> str:
    name: str = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    return name
