"""KvHintClient (blocking) and AsyncKvHintClient (grpc.aio): one typed surface over kvhint.v1.

    with KvHintClient("127.0.0.1:50151") as kv:
        result = kv.apply(session("S").pin(ttl=30), continuation("c1").evict())
        assert result.all_accepted, result.by_outcome

Contracts (both clients):
- Every failure raises KvHintError (status code + ErrorInfo); see errors.py.
- Unary calls retry on UNAVAILABLE only, per ConnectionConfig.retry, within one deadline
  (and on RESOURCE_EXHAUSTED with RetryInfo, after its delay, when the policy opts in).
- apply() gives every hint without a hint_id a uuid4 id before the first attempt (shorter random
  text when the server's limits.max_hint_id_length, once read, is under 36 bytes), so a retried
  batch is idempotent (the server replays the first result with `replayed=true`).
- query_residency() / list_sessions() follow next_page_token to the end; the *_page forms
  return one page.
- watch() returns a stream object: iterate it (sync) or `async for` it (asyncio); cancel() ends
  the iteration quietly. Streams are not retried; EventFollower handles reconnection.
- health() checks grpc.health.v1 for "kvhint.v1.KvHintService" and "" (the whole server).
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import Any, Mapping, Optional, TypeVar, Union

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvhint.v1 import kvhint_pb2, kvhint_pb2_grpc

from . import _rpc
from .builders import SelectorLike
from .config import ConfigLike, ConnectionConfig, as_config
from .durations import Seconds
from .errors import KvHintError
from .names import TierLike
from .results import ApplyResult, HealthReport, Residency

_Resp = TypeVar("_Resp")
EnvelopeLike = Union[Mapping[str, Any], str, bytes, Any]


def _sync_channel(config: ConnectionConfig) -> grpc.Channel:
    options = config.all_channel_options()
    if config.tls is not None:
        return grpc.secure_channel(config.address, config.tls.channel_credentials(), options=options)
    return grpc.insecure_channel(config.address, options=options)


def _aio_channel(config: ConnectionConfig) -> grpc.aio.Channel:
    options = config.all_channel_options()
    if config.tls is not None:
        return grpc.aio.secure_channel(config.address, config.tls.channel_credentials(), options=options)
    return grpc.aio.insecure_channel(config.address, options=options)


def _envelope_hints(envelope: EnvelopeLike) -> list[kvhint_pb2.Hint]:
    from .envelope import envelope_to_hints

    return envelope_to_hints(envelope)


# ---------------------------------------------------------------------------------------------
# Blocking client
# ---------------------------------------------------------------------------------------------


class WatchStream:
    """An open WatchEvents subscription. Iterate for WatchEventsResponse messages; cancel() (from
    any thread) ends the iteration without an error. Also a context manager that cancels on exit."""

    def __init__(self, call: Any, address: str) -> None:
        self._call = call
        self._address = address
        self._cancelled = False

    def __iter__(self) -> Iterator[kvhint_pb2.WatchEventsResponse]:
        try:
            for response in self._call:
                yield response
        except grpc.RpcError as error:
            if self._cancelled and error.code() == grpc.StatusCode.CANCELLED:
                return
            raise _rpc.rpc_error(error, "WatchEvents", self._address) from error

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def __enter__(self) -> "WatchStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


class _ClientBase:
    """What the sync and asyncio clients share: config, channel ownership, stubs, metadata."""

    def __init__(self, config: ConfigLike, channel: Any, make_channel: Callable[[ConnectionConfig], Any]) -> None:
        self._config = as_config(config)
        self._owns_channel = channel is None
        self._channel = channel if channel is not None else make_channel(self._config)
        self._stub = kvhint_pb2_grpc.KvHintServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._metadata = self._config.call_metadata()
        # The server's limits, from the last GetCapabilities answer (None before one).
        self._limits: Optional[kvhint_pb2.Limits] = None

    @property
    def limits(self) -> Optional[kvhint_pb2.Limits]:
        """The server's Limits from the last `capabilities()` call; `apply` checks
        batches against them before sending (None until capabilities were read)."""
        return self._limits

    def _remember(self, caps: kvhint_pb2.GetCapabilitiesResponse) -> kvhint_pb2.GetCapabilitiesResponse:
        self._limits = caps.limits
        return caps

    @property
    def config(self) -> ConnectionConfig:
        return self._config

    @property
    def address(self) -> str:
        return self._config.address


class KvHintClient(_ClientBase):
    """Blocking kvhint.v1 client. Thread-safe (one channel, shared by all calls).

    `config` is a ConnectionConfig or an address string. Pass `channel` to reuse an existing
    grpc.Channel (the client then does not close it).
    """

    def __init__(self, config: ConfigLike = ConnectionConfig(), *, channel: Optional[grpc.Channel] = None) -> None:
        super().__init__(config, channel, _sync_channel)

    # -- plumbing ---------------------------------------------------------------------------

    def _unary(self, method: str, call: Callable[..., _Resp], request: Any, timeout: Optional[float]) -> _Resp:
        attempts = _rpc.Attempts(self._config.retry, _rpc.resolve_timeout(self._config, timeout))
        while True:
            try:
                return call(request, timeout=attempts.attempt_timeout(), metadata=self._metadata)
            except grpc.RpcError as error:
                delay = attempts.retry_delay(error.code(), _rpc.retry_after_of(error))
                if delay is None:
                    raise _rpc.rpc_error(error, method, self.address) from error
                time.sleep(delay)

    # -- RPCs -------------------------------------------------------------------------------

    def capabilities(self, *, timeout: Optional[float] = None) -> kvhint_pb2.GetCapabilitiesResponse:
        """GetCapabilities: actions, tiers, limits, epoch and replay window of this engine."""
        response: kvhint_pb2.GetCapabilitiesResponse = self._unary(
            "GetCapabilities", self._stub.GetCapabilities, kvhint_pb2.GetCapabilitiesRequest(), timeout
        )
        return self._remember(response)

    def apply(self, *hints: kvhint_pb2.Hint, timeout: Optional[float] = None) -> ApplyResult:
        """ApplyHints: one batch, one result per hint, in order. Once `capabilities()`
        was read, a batch over the server's limits raises ValueError before sending."""
        _rpc.check_limits(hints, self._limits)
        prepared = _rpc.prepare_hints(hints, self._limits)
        request = kvhint_pb2.ApplyHintsRequest(hints=prepared)
        response = self._unary("ApplyHints", self._stub.ApplyHints, request, timeout)
        return _rpc.apply_result(prepared, response, self.address)

    def apply_envelope(self, envelope: EnvelopeLike, *, timeout: Optional[float] = None) -> ApplyResult:
        """Lower a KvHintsEnvelope (dict, JSON or vLLM's msgspec struct) and apply it; see envelope.py."""
        return self.apply(*_envelope_hints(envelope), timeout=timeout)

    def query_residency_page(
        self,
        selector: SelectorLike,
        *,
        tiers: Iterable[TierLike] = (),
        page_size: int = 0,
        page_token: str = "",
        timeout: Optional[float] = None,
    ) -> kvhint_pb2.QueryResidencyResponse:
        """One QueryResidency page."""
        request = _rpc.query_request(selector, tiers, page_size, page_token)
        page: kvhint_pb2.QueryResidencyResponse = self._unary("QueryResidency", self._stub.QueryResidency, request, timeout)
        return page

    def query_residency(
        self,
        selector: SelectorLike,
        *,
        tiers: Iterable[TierLike] = (),
        page_size: int = 0,
        timeout: Optional[float] = None,
    ) -> Residency:
        """Every QueryResidency page for `selector` (timeout applies per page)."""
        tiers = list(tiers)
        pages, tokens = _rpc.ResidencyPages(), _rpc.PageTokens("QueryResidency", self.address)
        while True:
            page = self.query_residency_page(selector, tiers=tiers, page_size=page_size, page_token=tokens.token, timeout=timeout)
            pages.add(page)
            if not tokens.advance(page.next_page_token):
                return pages.result()

    def list_sessions_page(
        self, *, prefix: str = "", page_size: int = 0, page_token: str = "", timeout: Optional[float] = None
    ) -> kvhint_pb2.ListSessionsResponse:
        """One ListSessions page."""
        request = _rpc.sessions_request(prefix, page_size, page_token)
        page: kvhint_pb2.ListSessionsResponse = self._unary("ListSessions", self._stub.ListSessions, request, timeout)
        return page

    def list_sessions(
        self, *, prefix: str = "", page_size: int = 0, timeout: Optional[float] = None
    ) -> list[kvhint_pb2.SessionInfo]:
        """Every session (ordered by id) whose id starts with `prefix` (timeout applies per page)."""
        sessions: list[kvhint_pb2.SessionInfo] = []
        tokens = _rpc.PageTokens("ListSessions", self.address)
        while True:
            page = self.list_sessions_page(prefix=prefix, page_size=page_size, page_token=tokens.token, timeout=timeout)
            sessions.extend(page.sessions)
            if not tokens.advance(page.next_page_token):
                return sessions

    def watch(
        self,
        start: _rpc.StartLike = None,
        *,
        resume: Optional[tuple[str, int]] = None,
        filter: Optional[kvhint_pb2.EventFilter] = None,
        heartbeat: Optional[Union[Seconds, _dt.timedelta]] = None,
        timeout: Optional[float] = None,
    ) -> WatchStream:
        """WatchEvents. start: "now" (default), "snapshot", or "resume" (implied by
        resume=(epoch, last_sequence_processed)). heartbeat: server heartbeat period.
        timeout: a deadline for the whole stream (default none)."""
        request = _rpc.watch_request(start, resume, filter, heartbeat)
        call = self._stub.WatchEvents(request, timeout=_rpc.stream_timeout(timeout), metadata=self._metadata)
        return WatchStream(call, self.address)

    def get_operation(self, operation_id: str, *, timeout: Optional[float] = None) -> kvhint_pb2.Operation:
        """GetOperation; an unknown id raises KvHintError(NOT_FOUND)."""
        if not operation_id:
            raise ValueError("operation_id must not be empty")
        request = kvhint_pb2.GetOperationRequest(operation_id=operation_id)
        response: kvhint_pb2.GetOperationResponse = self._unary("GetOperation", self._stub.GetOperation, request, timeout)
        return response.operation

    def wait_operation(self, operation_id: str, timeout: float = 30.0, *, poll_interval: float = 0.2) -> kvhint_pb2.Operation:
        """Poll GetOperation until SUCCEEDED or FAILED (returned, not raised); after `timeout`
        seconds raise KvHintError(DEADLINE_EXCEEDED)."""
        deadline = time.monotonic() + timeout
        last: Optional[kvhint_pb2.Operation] = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _rpc.operation_timeout_error(operation_id, last, timeout, self.address)
            last = self.get_operation(operation_id, timeout=_rpc.poll_timeout(self._config, remaining))
            if _rpc.operation_finished(last):
                return last
            time.sleep(max(0.0, min(poll_interval, deadline - time.monotonic())))

    def health(self, *, timeout: Optional[float] = None) -> HealthReport:
        """grpc.health.v1 Check for "kvhint.v1.KvHintService" and "" (the whole server)."""
        statuses: dict[str, str] = {}
        for service in _rpc.HEALTH_SERVICES:
            try:
                response = self._unary("Health.Check", self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout)
                statuses[service] = _rpc.health_status_name(response.status)
            except KvHintError as error:
                if error.code != grpc.StatusCode.NOT_FOUND:
                    raise
                statuses[service] = "SERVICE_UNKNOWN"
        return HealthReport(statuses)

    # -- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        if self._owns_channel:
            self._channel.close()

    def __enter__(self) -> "KvHintClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# asyncio client
# ---------------------------------------------------------------------------------------------


class AsyncWatchStream:
    """An open WatchEvents subscription for asyncio: `async for` the messages; cancel() ends the
    iteration without an error. Also an async context manager that cancels on exit."""

    def __init__(self, call: Any, address: str) -> None:
        self._call = call
        self._address = address
        self._cancelled = False

    def __aiter__(self) -> AsyncIterator[kvhint_pb2.WatchEventsResponse]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[kvhint_pb2.WatchEventsResponse]:
        try:
            async for response in self._call:
                yield response
        except asyncio.CancelledError:
            if self._cancelled:
                return
            raise
        except grpc.RpcError as error:
            if self._cancelled and error.code() == grpc.StatusCode.CANCELLED:
                return
            raise _rpc.rpc_error(error, "WatchEvents", self._address) from error

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    async def __aenter__(self) -> "AsyncWatchStream":
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()


class AsyncKvHintClient(_ClientBase):
    """asyncio kvhint.v1 client with the same surface as KvHintClient (methods are coroutines,
    watch() returns an AsyncWatchStream). Create it inside the event loop that uses it."""

    def __init__(self, config: ConfigLike = ConnectionConfig(), *, channel: Optional[grpc.aio.Channel] = None) -> None:
        super().__init__(config, channel, _aio_channel)

    async def _unary(
        self, method: str, call: Callable[..., Awaitable[_Resp]], request: Any, timeout: Optional[float]
    ) -> _Resp:
        attempts = _rpc.Attempts(self._config.retry, _rpc.resolve_timeout(self._config, timeout))
        while True:
            try:
                return await call(request, timeout=attempts.attempt_timeout(), metadata=self._metadata)
            except grpc.RpcError as error:
                delay = attempts.retry_delay(error.code(), _rpc.retry_after_of(error))
                if delay is None:
                    raise _rpc.rpc_error(error, method, self.address) from error
                await asyncio.sleep(delay)

    async def capabilities(self, *, timeout: Optional[float] = None) -> kvhint_pb2.GetCapabilitiesResponse:
        return self._remember(
            await self._unary("GetCapabilities", self._stub.GetCapabilities, kvhint_pb2.GetCapabilitiesRequest(), timeout)
        )

    async def apply(self, *hints: kvhint_pb2.Hint, timeout: Optional[float] = None) -> ApplyResult:
        _rpc.check_limits(hints, self._limits)
        prepared = _rpc.prepare_hints(hints, self._limits)
        request = kvhint_pb2.ApplyHintsRequest(hints=prepared)
        response = await self._unary("ApplyHints", self._stub.ApplyHints, request, timeout)
        return _rpc.apply_result(prepared, response, self.address)

    async def apply_envelope(self, envelope: EnvelopeLike, *, timeout: Optional[float] = None) -> ApplyResult:
        return await self.apply(*_envelope_hints(envelope), timeout=timeout)

    async def query_residency_page(
        self,
        selector: SelectorLike,
        *,
        tiers: Iterable[TierLike] = (),
        page_size: int = 0,
        page_token: str = "",
        timeout: Optional[float] = None,
    ) -> kvhint_pb2.QueryResidencyResponse:
        request = _rpc.query_request(selector, tiers, page_size, page_token)
        return await self._unary("QueryResidency", self._stub.QueryResidency, request, timeout)

    async def query_residency(
        self,
        selector: SelectorLike,
        *,
        tiers: Iterable[TierLike] = (),
        page_size: int = 0,
        timeout: Optional[float] = None,
    ) -> Residency:
        tiers = list(tiers)
        pages, tokens = _rpc.ResidencyPages(), _rpc.PageTokens("QueryResidency", self.address)
        while True:
            page = await self.query_residency_page(
                selector, tiers=tiers, page_size=page_size, page_token=tokens.token, timeout=timeout
            )
            pages.add(page)
            if not tokens.advance(page.next_page_token):
                return pages.result()

    async def list_sessions_page(
        self, *, prefix: str = "", page_size: int = 0, page_token: str = "", timeout: Optional[float] = None
    ) -> kvhint_pb2.ListSessionsResponse:
        request = _rpc.sessions_request(prefix, page_size, page_token)
        return await self._unary("ListSessions", self._stub.ListSessions, request, timeout)

    async def list_sessions(
        self, *, prefix: str = "", page_size: int = 0, timeout: Optional[float] = None
    ) -> list[kvhint_pb2.SessionInfo]:
        sessions: list[kvhint_pb2.SessionInfo] = []
        tokens = _rpc.PageTokens("ListSessions", self.address)
        while True:
            page = await self.list_sessions_page(prefix=prefix, page_size=page_size, page_token=tokens.token, timeout=timeout)
            sessions.extend(page.sessions)
            if not tokens.advance(page.next_page_token):
                return sessions

    def watch(
        self,
        start: _rpc.StartLike = None,
        *,
        resume: Optional[tuple[str, int]] = None,
        filter: Optional[kvhint_pb2.EventFilter] = None,
        heartbeat: Optional[Union[Seconds, _dt.timedelta]] = None,
        timeout: Optional[float] = None,
    ) -> AsyncWatchStream:
        request = _rpc.watch_request(start, resume, filter, heartbeat)
        call = self._stub.WatchEvents(request, timeout=_rpc.stream_timeout(timeout), metadata=self._metadata)
        return AsyncWatchStream(call, self.address)

    async def get_operation(self, operation_id: str, *, timeout: Optional[float] = None) -> kvhint_pb2.Operation:
        if not operation_id:
            raise ValueError("operation_id must not be empty")
        request = kvhint_pb2.GetOperationRequest(operation_id=operation_id)
        response: kvhint_pb2.GetOperationResponse = await self._unary(
            "GetOperation", self._stub.GetOperation, request, timeout
        )
        return response.operation

    async def wait_operation(
        self, operation_id: str, timeout: float = 30.0, *, poll_interval: float = 0.2
    ) -> kvhint_pb2.Operation:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        last: Optional[kvhint_pb2.Operation] = None
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise _rpc.operation_timeout_error(operation_id, last, timeout, self.address)
            last = await self.get_operation(operation_id, timeout=_rpc.poll_timeout(self._config, remaining))
            if _rpc.operation_finished(last):
                return last
            await asyncio.sleep(max(0.0, min(poll_interval, deadline - loop.time())))

    async def health(self, *, timeout: Optional[float] = None) -> HealthReport:
        statuses: dict[str, str] = {}
        for service in _rpc.HEALTH_SERVICES:
            try:
                response = await self._unary(
                    "Health.Check", self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout
                )
                statuses[service] = _rpc.health_status_name(response.status)
            except KvHintError as error:
                if error.code != grpc.StatusCode.NOT_FOUND:
                    raise
                statuses[service] = "SERVICE_UNKNOWN"
        return HealthReport(statuses)

    async def close(self) -> None:
        if self._owns_channel:
            await self._channel.close()

    async def __aenter__(self) -> "AsyncKvHintClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
