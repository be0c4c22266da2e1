"""KvHintServicer: the kvhint.v1.KvHintService RPCs on grpc.aio.

Handlers take raw request bytes and parse them here, so an undecodable
request is INVALID_ARGUMENT (with ErrorInfo) instead of grpc's generic
INTERNAL. Work that touches engine state runs on the engine thread through
KvHintCore.submit and is awaited with the RPC's deadline.

Overload (kvhint_server/overload.py): each RPC that reaches the engine thread
is validated, then spends its cost from the caller's rate limit, then submits
bounded; either refusal is RESOURCE_EXHAUSTED with RetryInfo, with nothing
applied. A request refused as a whole (INVALID_ARGUMENT, PERMISSION_DENIED)
costs nothing, and a call refused after its cost was spent (a full queue, the
open-stream bounds) gets it back: nothing of it ran.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from google.protobuf import message as pb_message

from kvhint.v1 import kvhint_pb2 as pb

from . import wire
from .config import ServerConfig
from .core import EngineStopped, KvHintCore, TaskFuture
from .errors import RpcError, excerpt, invalid_argument, not_found, resource_exhausted, unavailable
from .model import Reason
from .overload import CAUSE_QUEUE_FULL, CAUSE_RATE_LIMITED, QueueFull, RateLimiter, TenantQueueShares, principal_of
from .page_tokens import PageTokens
from . import tenant_guard
from .tenancy import Tenant, current_principal
from .validation import apply_cost, check_apply_batch_size, check_request_id, parse_hints, parse_query_selector, parse_query_tiers, validate_watch_request
from .watch import WatchHub

if TYPE_CHECKING:
    from .metrics import KvHintMetrics

log = logging.getLogger("kvhint.servicer")
SERVICE = "kvhint.v1.KvHintService"
T = TypeVar("T")
Msg = TypeVar("Msg", bound=pb_message.Message)


def _page_scope(tenant: Tenant | None, *query: bytes) -> str:
    """A page token's scope: a digest of the query's parts and, with tenancy, of the calling
    tenant's name, so a token serves the same query of the same caller only (another tenant's
    or an admin's is refused, field page_token). Each part is length-prefixed: no two
    different queries digest the same bytes."""
    digest = hashlib.sha256()
    for part in (*query, tenant.name.encode() if tenant is not None else b""):
        digest.update(len(part).to_bytes(8, "big") + part)
    return digest.hexdigest()[:16]


def _parse(cls: type[Msg], raw: bytes) -> Msg:
    try:
        return cls.FromString(raw)
    except pb_message.DecodeError as exc:
        raise invalid_argument(f"cannot decode {cls.DESCRIPTOR.name}: {exc}", "") from exc


class KvHintServicer:
    def __init__(self, core: KvHintCore, config: ServerConfig) -> None:
        self.core = core
        self.config = config
        self.executor = core.executor
        self.queries = core.queries
        self.hub: WatchHub | None = None
        self._page_tokens = PageTokens(core.bus.epoch)
        self.rate_limiter = RateLimiter.from_config(config)
        # Metrics (kvhint_server.metrics), set by the server when exported.
        self.metrics: KvHintMetrics | None = None
        # Tenancy (tenancy.py, tenant_guard.py): None without KVHINT_TENANTS_FILE.
        self.tenants = config.tenants
        # Each tenant's share of the engine-thread queue (overload.py); None without tenancy.
        self.queue_shares = (
            TenantQueueShares(config.max_pending_tasks, core.overload, core.queue_retry_after) if self.tenants is not None else None
        )

    def _scoped(self) -> Tenant | None:
        """The calling tenant when its view is limited (None: no tenancy, or an admin)."""
        if self.tenants is None:
            return None
        principal = current_principal()
        return principal if principal is not None and not principal.admin else None

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self.hub = WatchHub(self.core, self.queries, self.config, loop, self.queue_shares)
        if self.metrics is not None:
            self.hub.on_snapshot = self.metrics.snapshot_seconds.observe

    # ------------------------------------------------------------ plumbing

    def _rate_limit(self, context: grpc.aio.ServicerContext, cost: int) -> str:
        """Spend `cost` from the caller's bucket (RpcError if over); returns the principal."""
        if self.rate_limiter is None:
            return ""
        # With tenancy the bucket is the tenant's (one per tenant, whichever
        # token or certificate it uses); otherwise the caller's credential or peer.
        tenant = current_principal() if self.tenants is not None else None
        principal = "tenant:" + tenant.name if tenant is not None else principal_of(context)
        own = tenant.rate_limit if tenant is not None else None
        wait = self.rate_limiter.take(principal, cost, own)
        if wait > 0:
            self.core.overload.rate_limited += 1
            limit = self.rate_limiter.limit_for(own)
            assert limit is not None  # a bucket refused
            if cost > limit.burst:
                message = f"rate limited: a call costing {cost} exceeds the burst of {limit.burst}; split it"
            else:
                message = f"rate limited ({limit.rate:g}/s, burst {limit.burst}): retry in {wait:.3f}s"
            raise resource_exhausted(message, CAUSE_RATE_LIMITED, wait)
        return principal

    def _give_back(self, principal: str, cost: int) -> None:
        """Refund `cost` to `principal`'s bucket: the call it paid for was refused and nothing ran."""
        if self.rate_limiter is not None:
            self.rate_limiter.give_back(principal, cost)

    async def _on_engine(self, fn: Callable[[], T], context: grpc.aio.ServicerContext, principal: str, cost: int) -> T:
        """Run `fn` on the engine thread, bounded by the RPC deadline (`cost`: what `principal`
        paid for the call, given back if the queue refuses it)."""
        return await self._await_engine(self._submit_paid(fn, principal, cost), context)

    def _submit_paid(self, fn: Callable[[], T], principal: str, cost: int) -> TaskFuture[T]:
        """`_submit`, giving `cost` back to `principal` when the queue refuses the task at once."""
        future = self._submit(fn)
        if future.done() and isinstance(future.exception(), QueueFull):
            self._give_back(principal, cost)  # refused at once: nothing ran, nothing spent
        return future

    def _submit(self, fn: Callable[[], T]) -> TaskFuture[T]:
        """`fn` on the engine thread, bounded by the queue and, for a tenant, by its share of it
        (QueueFull either way: nothing queued)."""
        tenant = self._scoped()
        if tenant is None or self.queue_shares is None:
            return self.core.submit(fn, bounded=True)
        try:
            return self.queue_shares.submit(tenant.name, lambda: self.core.submit(fn, bounded=True))
        except QueueFull as exc:
            refused: TaskFuture[T] = TaskFuture()
            refused.set_exception(exc)
            return refused

    async def _await_engine(self, future: TaskFuture[T], context: grpc.aio.ServicerContext) -> T:
        """The engine task's result, bounded by the RPC deadline and engine_task_timeout_s. A task
        the engine thread has not started when the call ends (its deadline passed, or the client
        cancelled it) is withdrawn: it does not run after the caller was told it failed."""
        remaining = context.time_remaining()
        timeout = self.config.engine_task_timeout_s if remaining is None else min(remaining, self.config.engine_task_timeout_s)
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout=timeout)
        except asyncio.CancelledError:  # gRPC ended the call (deadline or cancellation) first
            future.cancel()
            raise
        except asyncio.TimeoutError:
            if future.cancel():
                raise unavailable(Reason.DEADLINE_EXCEEDED, f"the engine did not reach a step boundary within {timeout:.1f}s") from None
            return await asyncio.wrap_future(future)
        except EngineStopped as exc:
            raise unavailable(Reason.SHUTTING_DOWN, str(exc)) from exc
        except QueueFull as exc:
            raise resource_exhausted(f"{exc}; retry in {exc.retry_after:.3f}s", CAUSE_QUEUE_FULL, exc.retry_after) from None

    # ------------------------------------------------------------ RPCs

    async def GetCapabilities(self, request: pb.GetCapabilitiesRequest, context: grpc.aio.ServicerContext) -> pb.GetCapabilitiesResponse:
        return wire.capabilities(self.core.info, self.config, self.core.bus.epoch, self.core.ledger.pin_budget_blocks)

    async def ApplyHints(self, request: pb.ApplyHintsRequest, context: grpc.aio.ServicerContext) -> pb.ApplyHintsResponse:
        if self.metrics is not None:
            with self.metrics.apply_seconds.time():
                return await self._apply_hints(request, context)
        return await self._apply_hints(request, context)

    async def _apply_hints(self, request: pb.ApplyHintsRequest, context: grpc.aio.ServicerContext) -> pb.ApplyHintsResponse:
        check_apply_batch_size(request, self.config)  # refused as a whole: no rate-limit tokens spent
        cost = apply_cost(request)
        principal = self._rate_limit(context, cost)
        parsed = parse_hints(request.hints, self.config, self.core.info)  # per-hint problems are results
        tenant = self._scoped()
        guard = tenant_guard.TenantGuard(self.core, self.tenants, tenant) if tenant is not None else None
        future = self._submit_paid(lambda: self.executor.apply_batch(parsed, guard), principal, cost)
        applied = await self._await_engine(future, context)
        if future.deferred_steps:
            self.core.overload.deferred_batches += 1
        return pb.ApplyHintsResponse(
            results=applied.messages, epoch=self.core.bus.epoch, applied_at_sequence=applied.sequence,
            deferred_steps=future.deferred_steps,
        )

    def page_tokens(self) -> PageTokens:
        """The page-token codec of the current epoch (a new key per epoch)."""
        epoch = self.core.bus.epoch
        if self._page_tokens.epoch != epoch:
            self._page_tokens = PageTokens(epoch)
        return self._page_tokens

    def _page_size(self, asked: int) -> int:
        return min(asked or self.config.default_page_size, self.config.max_page_size)

    async def QueryResidency(self, request: pb.QueryResidencyRequest, context: grpc.aio.ServicerContext) -> pb.QueryResidencyResponse:
        selector = parse_query_selector(request.selector, request.HasField("selector"), self.config)
        tiers = parse_query_tiers(request.tiers)
        tenant = self._scoped()
        tenant_guard.check_query_selector(tenant, selector)
        tokens = self.page_tokens()
        scope = _page_scope(tenant, request.selector.SerializeToString(deterministic=True), bytes(sorted(tiers)))
        offset = tokens.verify(request.page_token, scope, "o", int, 0) if request.page_token else 0
        size = self._page_size(request.page_size)
        principal = self._rate_limit(context, 1)  # after validation: a request refused as a whole costs nothing
        if tenant is not None:
            tenants = self.tenants
            residency = await self._on_engine(lambda: tenant_guard.scope_residency(
                self.core, tenants, tenant, self.queries.residency(selector, tiers)), context, principal, 1)
        else:
            residency = await self._on_engine(lambda: self.queries.residency(selector, tiers), context, principal, 1)
        page = residency.blocks[offset : offset + size]
        block_size = self.core.info.block_size
        response = pb.QueryResidencyResponse(
            blocks=[wire.block_info(b, block_size) for b in page],
            totals=wire.tier_counts(residency.totals),
            as_of_epoch=tokens.epoch,
            as_of_sequence=residency.sequence,
        )
        if offset + size < len(residency.blocks):
            response.next_page_token = tokens.issue(scope, "o", offset + size)
        return response

    async def ListSessions(self, request: pb.ListSessionsRequest, context: grpc.aio.ServicerContext) -> pb.ListSessionsResponse:
        prefix = check_request_id(request.session_id_prefix, "session_id_prefix", self.config.max_id_length, required=False)
        tenant = self._scoped()
        tokens = self.page_tokens()
        scope = _page_scope(tenant, prefix.encode())
        after = tokens.verify(request.page_token, scope, "a", str, self.config.max_id_length) if request.page_token else None
        size = self._page_size(request.page_size)
        principal = self._rate_limit(context, 1)  # after validation: a request refused as a whole costs nothing
        listed = tenant_guard.narrow_prefix(tenant, prefix)
        if listed is None:  # no session of the caller's namespace can match
            return pb.ListSessionsResponse(as_of_epoch=tokens.epoch, as_of_sequence=self.core.bus.last_sequence)
        page = await self._on_engine(lambda: self.queries.sessions(listed, after, size), context, principal, 1)
        response = pb.ListSessionsResponse(
            sessions=[wire.session_info(s) for s in page.sessions], as_of_epoch=tokens.epoch, as_of_sequence=page.sequence
        )
        if tenant is not None:
            for info in response.sessions:  # another tenant's parent is not the caller's to see
                if info.parent_session_id and not tenant.owns(info.parent_session_id):
                    info.parent_session_id = ""
        if page.next_after is not None:
            response.next_page_token = tokens.issue(scope, "a", page.next_after)
        return response

    async def GetOperation(self, request: pb.GetOperationRequest, context: grpc.aio.ServicerContext) -> pb.GetOperationResponse:
        operation_id = check_request_id(request.operation_id, "operation_id", self.config.max_id_length)
        op = self.core.operations.get(operation_id)
        tenant = self._scoped()
        if op is None or (tenant is not None and not tenant_guard.owns_operation(tenant, op)):
            raise not_found(f"no operation {excerpt(operation_id)}", "operation_id")
        return pb.GetOperationResponse(operation=wire.operation(op))

    async def WatchEvents(self, request: pb.WatchEventsRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.WatchEventsResponse | bytes]:
        validate_watch_request(request, self.config)
        assert self.hub is not None
        tenant = self._scoped()
        scope = tenant_guard.WatchScope(tenant, self.tenants) if tenant is not None and self.tenants is not None else None
        if scope is not None:
            scope.check_filter(request.filter.session_ids)
        payer = self._rate_limit(context, 1)  # after validation: a request refused as a whole costs nothing
        principal = current_principal() if self.tenants is not None else None
        admitted = False
        try:
            with self.hub.admit(principal.name if principal is not None else None):  # open-stream bounds
                admitted = True
                async for message in self.hub.stream(request, scope):
                    yield message
        except QueueFull as exc:  # the snapshot's first task, before any message
            self._give_back(payer, 1)
            raise resource_exhausted(f"{exc}; retry in {exc.retry_after:.3f}s", CAUSE_QUEUE_FULL, exc.retry_after) from None
        except RpcError:
            if not admitted:  # refused by the open-stream bounds: no stream, nothing ran
                self._give_back(payer, 1)
            raise


# ---------------------------------------------------------------- registration

_UNARY: dict[str, tuple[type[pb_message.Message], type[pb_message.Message]]] = {
    "GetCapabilities": (pb.GetCapabilitiesRequest, pb.GetCapabilitiesResponse),
    "ApplyHints": (pb.ApplyHintsRequest, pb.ApplyHintsResponse),
    "QueryResidency": (pb.QueryResidencyRequest, pb.QueryResidencyResponse),
    "ListSessions": (pb.ListSessionsRequest, pb.ListSessionsResponse),
    "GetOperation": (pb.GetOperationRequest, pb.GetOperationResponse),
}


async def _abort_internal(context: grpc.aio.ServicerContext, method: Callable[..., Any]) -> None:
    """An unexpected error in `method`: logged here, INTERNAL with ErrorInfo on the wire."""
    log.exception("kvhint: %s failed", getattr(method, "__name__", "RPC"))
    await _abort(context, RpcError(
        grpc.StatusCode.INTERNAL, Reason.OPERATION_FAILED, "internal error in the KvHint server (see its log)"
    ))


async def _abort(context: grpc.aio.ServicerContext, err: RpcError) -> None:
    status = err.to_status()
    await context.abort(status.code, status.details, trailing_metadata=status.trailing_metadata)


def _unary(method: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]], req_cls: type[pb_message.Message]):
    async def handler(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(_parse(req_cls, raw), context)
        except RpcError as err:
            await _abort(context, err)
        except grpc.aio.AbortError:
            raise
        except Exception:  # noqa: BLE001 - INTERNAL with ErrorInfo, not UNKNOWN with the exception's text
            await _abort_internal(context, method)

    return handler


def _stream(method: Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]], req_cls: type[pb_message.Message]):
    async def handler(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for item in method(_parse(req_cls, raw), context):
                yield item
        except RpcError as err:
            await _abort(context, err)
        except grpc.aio.AbortError:
            raise
        except Exception:  # noqa: BLE001 - as _unary
            await _abort_internal(context, method)

    return handler


def generic_handler(servicer: KvHintServicer) -> grpc.GenericRpcHandler:
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for name, (req_cls, _resp_cls) in _UNARY.items():
        handlers[name] = grpc.unary_unary_rpc_method_handler(
            _unary(getattr(servicer, name), req_cls),
            request_deserializer=None,
            response_serializer=lambda m: m.SerializeToString(),
        )
    handlers["WatchEvents"] = grpc.unary_stream_rpc_method_handler(
        _stream(servicer.WatchEvents, pb.WatchEventsRequest),
        request_deserializer=None,
        # Events arrive pre-serialized (shared by all subscribers).
        response_serializer=lambda m: m if isinstance(m, bytes) else m.SerializeToString(),
    )
    return grpc.method_handlers_generic_handler(SERVICE, handlers)
