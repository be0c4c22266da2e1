"""WatchEvents: subscriptions over the EventBus, on the server's asyncio loop.

Semantics (etcd-style):
  * START_NOW: events after the current sequence.
  * START_SNAPSHOT: SnapshotBegin, SnapshotChunk..., SnapshotEnd, then every
    event after SnapshotEnd's sequence, no gap. The snapshot is taken in
    slices on the engine thread (snapshot.py, a bounded time per step); the
    events that happen meanwhile are sent between the chunks, each before the
    first chunk taken after it. A tenant's snapshot tasks hold places in its
    share of the engine queue (overload.TenantQueueShares) as its other calls
    do: the first is refused queue_full when the share is full, each later
    slice waits for a place.
  * START_RESUME(epoch, seq): every event after seq; a different epoch, a seq
    outside the replay window, or a seq ahead of the latest gives one Resync
    message and the stream ends.
  * Heartbeats carry the latest sequence when nothing was sent for an interval.
  * A subscriber whose send has been blocked for `subscriber_stall_s` (it
    stopped reading and gRPC flow control pushed back) may lag at most
    `subscriber_buffer` events. Past that
    it is marked overflowed: it reads nothing more from the ring, and once the
    client drains what gRPC already buffered, the stream ends with a Resync
    (SUBSCRIBER_OVERFLOW). A subscriber that is reading is not cut off for
    lagging, but a live one (past its resume point or SnapshotEnd) that the
    replay window passes first (events published faster than it takes them,
    whether it stopped reading or not) has lost events: it ends with
    SUBSCRIBER_OVERFLOW too, where the first lost event would have been sent.
    COMPACTED means a requested position the window has passed: a
    START_RESUME sequence older than the window (when requested, or by the
    stream's first read of the ring), or events a snapshot had yet to send
    between its pieces. Per subscriber the server keeps a cursor
    and what gRPC buffers; the engine thread never waits for a subscriber.
  * Open streams are bounded (snapshots included): KVHINT_MAX_WATCH_STREAMS in
    all and, with tenancy, KVHINT_MAX_WATCH_STREAMS_PER_TENANT per tenant
    (admins included). Past either, WatchEvents fails at once with RESOURCE_EXHAUSTED,
    ErrorInfo reason REASON_RESOURCE_EXHAUSTED, metadata {"cause":
    "watch_streams" | "tenant_watch_streams", "limit": <the bound>}, and no
    RetryInfo (a slot frees when another stream ends).
  * Per event a subscription does O(1) work when the event is not for it: a
    tenant's selects by the event's tenant tag (tenant_guard.WatchScope), set
    once when it was published.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvhint.v1 import kvhint_pb2 as pb

from . import wire
from .config import MAX_HEARTBEAT_S, MIN_HEARTBEAT_S, ServerConfig
from .core import EngineStopped, KvHintCore, TaskFuture
from .errors import RpcError, excerpt, resource_exhausted
from .events import Event, EventBus
from .model import Tier, parse_enum
from .overload import CAUSE_TENANT_WATCH_STREAMS, CAUSE_WATCH_STREAMS, TenantQueueShares
from .queries import BlockView, Queries
from .snapshot import SnapshotCursor, SnapshotPiece, SnapshotStart

if TYPE_CHECKING:
    from .tenant_guard import WatchScope

READ_BATCH = 256
SNAPSHOT_CHUNK_BLOCKS = 512


@dataclass(frozen=True, slots=True)
class EventFilter:
    sessions: frozenset[str] = frozenset()
    tiers: frozenset[Tier] = frozenset()
    kinds: frozenset[int] = frozenset()

    @classmethod
    def from_wire(cls, f: pb.EventFilter) -> EventFilter:
        return cls(
            sessions=frozenset(f.session_ids),
            tiers=frozenset(t for t in (parse_enum(Tier, v) for v in f.tiers) if t is not None),
            kinds=frozenset(int(k) for k in f.kinds),
        )

    def matches(self, ev: Event) -> bool:
        if self.kinds and int(ev.kind) not in self.kinds:
            return False
        if self.tiers and ev.tier is not None and ev.tier not in self.tiers:
            return False
        if self.sessions and self.sessions.isdisjoint(ev.sessions):
            return False
        return True


@dataclass(eq=False)
class Subscriber:
    cursor: int
    buffer: int
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    # Loop time at which the message being handed to gRPC was yielded (the
    # generator is suspended at `yield` until flow control accepts it); None
    # when not sending.
    sending_since: float | None = None
    overflowed: bool = False


class WatchHub:
    """Fans EventBus wake-ups out to the subscribers on one asyncio loop."""

    def __init__(self, core: KvHintCore, queries: Queries, config: ServerConfig, loop: asyncio.AbstractEventLoop,
                 queue_shares: TenantQueueShares | None = None) -> None:
        self._core = core
        self._bus: EventBus = core.bus
        self._queries = queries
        self._config = config
        self._loop = loop
        self._subs: set[Subscriber] = set()
        # Open streams (snapshots included), in all and per tenant; the loop's alone (`admit`).
        self._open = 0
        self._open_by_tenant: dict[str, int] = {}
        self.max_streams = config.max_watch_streams
        self.max_streams_per_tenant = config.max_watch_streams_per_tenant
        # The tenants' shares of the engine queue (the servicer's), which a tenant's snapshot
        # tasks go through as its other calls' do; None without tenancy.
        self._queue_shares = queue_shares
        self._scheduled = False
        self._closing = False
        # At most this many blocks or sessions per snapshot piece (None: the
        # engine-step time budget alone bounds a piece); tests set it.
        self.snapshot_max_items: int | None = None
        # Called with each completed snapshot's duration, SnapshotBegin to
        # SnapshotEnd in seconds (metrics).
        self.on_snapshot: Callable[[float], None] | None = None
        self._bus.add_wake_hook(self._poke)

    @property
    def subscribers(self) -> int:
        return len(self._subs)

    def lag(self) -> tuple[int, int]:
        """(open WatchEvents streams, snapshots in progress included as `admit` counts them;
        events the furthest-behind live subscription has yet to receive). Any thread: reads a
        copy of the subscriber set."""
        subs = list(self._subs)
        last = self._bus.last_sequence
        return max(self._open, len(subs)), max((last - s.cursor for s in subs), default=0)

    @contextlib.contextmanager
    def admit(self, tenant: str | None = None) -> Iterator[None]:
        """The loop: hold a slot for one WatchEvents stream while the body runs. `tenant`: the
        caller's tenant with tenancy. RESOURCE_EXHAUSTED (RpcError) when a bound is reached, counted
        in the core's OverloadStats (the rejections metric)."""
        stats = self._core.overload
        if self._open >= self.max_streams:
            stats.watch_streams += 1
            raise _too_many(f"{self._open} WatchEvents streams are open, the server's limit", CAUSE_WATCH_STREAMS, self.max_streams)
        held = self._open_by_tenant.get(tenant, 0) if tenant is not None else 0
        if tenant is not None and held >= self.max_streams_per_tenant:
            stats.tenant_watch_streams += 1
            raise _too_many(f"tenant {tenant!r} has {held} WatchEvents streams open, its limit",
                            CAUSE_TENANT_WATCH_STREAMS, self.max_streams_per_tenant)
        self._open += 1
        if tenant is not None:
            self._open_by_tenant[tenant] = held + 1
        try:
            yield
        finally:
            self._open -= 1
            if tenant is not None:
                left = self._open_by_tenant[tenant] - 1
                if left:
                    self._open_by_tenant[tenant] = left
                else:
                    del self._open_by_tenant[tenant]

    def close(self) -> None:
        """Stop accepting wake-ups; streams end with a SHUTTING_DOWN resync."""
        self._closing = True
        self._bus.remove_wake_hook(self._poke)
        for sub in self._subs:
            sub.wake.set()

    def _poke(self) -> None:
        # Engine thread: at most one pending loop callback at a time.
        if self._subs and not self._scheduled:
            self._scheduled = True
            with contextlib.suppress(RuntimeError):  # loop already closed
                self._loop.call_soon_threadsafe(self._dispatch)

    def _dispatch(self) -> None:
        self._scheduled = False
        last = self._bus.last_sequence
        stalled_before = self._loop.time() - self._config.subscriber_stall_s
        for sub in self._subs:
            since = sub.sending_since
            if since is not None and since < stalled_before and last - sub.cursor > sub.buffer:
                sub.overflowed = True
            sub.wake.set()

    def _resync(self, cause: int, message: str) -> pb.WatchEventsResponse:
        bus = self._bus
        return pb.WatchEventsResponse(
            epoch=bus.epoch,
            sequence=bus.last_sequence,
            resync=pb.Resync(cause=cause, oldest_sequence=bus.oldest_sequence, current_epoch=bus.epoch, message=message),
        )

    def _control(self, sequence: int, **payload: object) -> pb.WatchEventsResponse:
        return pb.WatchEventsResponse(epoch=self._bus.epoch, sequence=sequence, **payload)  # type: ignore[arg-type]

    async def _snapshot(self, flt: EventFilter, scope: WatchScope | None = None) -> AsyncIterator[pb.WatchEventsResponse | bytes | int]:
        """SnapshotBegin, then pieces with the events before each, then
        SnapshotEnd; finally the sequence the stream continues after (an int).
        Ends without it after a Resync (the events between pieces were
        dropped from the replay window, or the server is shutting down)."""
        core, bus = self._core, self._bus
        snap = (
            SnapshotCursor(self._queries, self.snapshot_max_items)
            if scope is None
            else SnapshotCursor(self._queries, self.snapshot_max_items, scope.owned, scope.tenant.owns)
        )
        tenant = scope.tenant.name if scope is not None else None
        began = time.perf_counter()
        try:
            start = await asyncio.wrap_future(self._begin(snap, tenant))  # QueueFull: nothing sent yet
        except EngineStopped:  # the server is stopping (core.stop() failed the queued task)
            yield self._resync(pb.Resync.CAUSE_SHUTTING_DOWN, "server is shutting down")
            return
        sent = start.sequence
        yield self._control(sent, snapshot_begin=pb.SnapshotBegin(num_sessions=start.num_sessions, num_blocks=start.num_blocks))
        block_size = core.info.block_size
        done = snap.done
        while not done:
            if self._closing:
                yield self._resync(pb.Resync.CAUSE_SHUTTING_DOWN, "server is shutting down")
                return
            try:
                piece = await self._slice(snap, tenant)
            except EngineStopped:
                yield self._resync(pb.Resync.CAUSE_SHUTTING_DOWN, "server is shutting down")
                return
            done = piece.done
            while sent < piece.sequence:
                events = bus.read_after(sent, min(READ_BATCH, piece.sequence - sent))
                if events is None:
                    yield self._resync(pb.Resync.CAUSE_COMPACTED, f"events after {sent} are no longer kept")
                    return
                sent = events[-1].sequence if events else sent
                for ev in events if scope is None else scope.visible(events):
                    if flt.matches(ev):
                        yield wire.event_bytes(ev, bus.epoch) if scope is None else scope.event_bytes(ev, bus.epoch)
            for session_id, views in piece.chunks:  # a tenant's cursor yields only its sessions
                for message in self._chunks(piece.sequence, session_id, views, block_size):
                    if scope is not None:
                        scope.cut_blocks(message.snapshot_chunk.blocks)
                    yield message
        yield self._control(sent, snapshot_end=pb.SnapshotEnd())
        if self.on_snapshot is not None:
            self.on_snapshot(time.perf_counter() - began)
        yield sent

    def _begin(self, snap: SnapshotCursor, tenant: str | None) -> TaskFuture[SnapshotStart]:
        """A snapshot's first task, bounded by the queue and, for a tenant, by its share of it
        (QueueFull, nothing queued, as any of its calls would be refused)."""
        def submit() -> TaskFuture[SnapshotStart]:
            return self._core.submit(snap.begin, bounded=True)

        shares = self._queue_shares
        return submit() if tenant is None or shares is None else shares.submit(tenant, submit)

    async def _slice(self, snap: SnapshotCursor, tenant: str | None) -> SnapshotPiece:
        """A snapshot's next slice. A tenant's waits for a place in its share of the queue (the
        snapshot was admitted, and a refusal now would waste what was sent), so its snapshots
        never hold more of the queue than its share; EngineStopped if the server closes meanwhile."""
        shares = self._queue_shares
        if tenant is None or shares is None:
            return await asyncio.wrap_future(self._core.submit_slice(snap.step))
        while shares.enter(tenant) is not None:
            if self._closing:
                raise EngineStopped("server is shutting down")
            await asyncio.sleep(shares.retry_after())
        return await asyncio.wrap_future(shares.hold(tenant, self._core.submit_slice(snap.step)))

    def _chunks(self, sequence: int, session_id: str, views: list[BlockView], block_size: int) -> list[pb.WatchEventsResponse]:
        return [
            self._control(
                sequence,
                snapshot_chunk=pb.SnapshotChunk(
                    session_id=session_id,
                    blocks=[wire.block_info(b, block_size) for b in views[i : i + SNAPSHOT_CHUNK_BLOCKS]],
                ),
            )
            for i in range(0, max(1, len(views)), SNAPSHOT_CHUNK_BLOCKS)
        ]

    async def stream(
        self, request: pb.WatchEventsRequest, scope: WatchScope | None = None
    ) -> AsyncIterator[pb.WatchEventsResponse | bytes]:
        """Messages for one subscription: control messages, and events already
        serialized (shared by all subscribers). `scope`: a tenant's view
        (tenant_guard.WatchScope): only its events, foreign session ids cut."""
        bus = self._bus
        flt = EventFilter.from_wire(request.filter)
        heartbeat = self._config.heartbeat_interval_s
        if request.HasField("heartbeat_interval"):
            asked = request.heartbeat_interval.seconds + request.heartbeat_interval.nanos / 1e9
            if asked > 0:
                heartbeat = min(MAX_HEARTBEAT_S, max(MIN_HEARTBEAT_S, asked))
        start = request.start
        if start == pb.WatchEventsRequest.START_RESUME:
            cursor = request.resume_after_sequence
            if request.resume_epoch != bus.epoch:
                yield self._resync(pb.Resync.CAUSE_EPOCH_CHANGED, f"epoch {excerpt(request.resume_epoch)} is not the current epoch")
                return
            if cursor > bus.last_sequence:
                yield self._resync(pb.Resync.CAUSE_FUTURE_SEQUENCE, f"sequence {cursor} is ahead of {bus.last_sequence}")
                return
            if cursor + 1 < bus.oldest_sequence:
                yield self._resync(pb.Resync.CAUSE_COMPACTED, f"events after {cursor} are no longer kept")
                return
        elif start == pb.WatchEventsRequest.START_SNAPSHOT:
            cursor = None
            async for message in self._snapshot(flt, scope):
                if isinstance(message, int):
                    cursor = message
                else:
                    yield message
            if cursor is None:
                return  # the snapshot ended the stream (Resync)
        else:
            cursor = bus.last_sequence

        sub = Subscriber(cursor=cursor, buffer=self._config.subscriber_buffer)
        self._subs.add(sub)
        loop = asyncio.get_running_loop()
        last_sent = loop.time()
        # Until the first read of the ring, a resumed cursor is the requested position: if the
        # window passed it since the check above (the engine thread publishes meanwhile), the
        # request was for compacted events. Later, the subscriber fell behind live events.
        requested = start == pb.WatchEventsRequest.START_RESUME
        try:
            while True:
                if self._closing:
                    yield self._resync(pb.Resync.CAUSE_SHUTTING_DOWN, "server is shutting down")
                    return
                if sub.overflowed:
                    yield self._resync(
                        pb.Resync.CAUSE_SUBSCRIBER_OVERFLOW, f"subscriber fell more than {sub.buffer} events behind"
                    )
                    return
                events = bus.read_after(sub.cursor, READ_BATCH)
                if events is None and requested:
                    yield self._resync(pb.Resync.CAUSE_COMPACTED, f"events after {sub.cursor} are no longer kept")
                    return
                if events is None:  # the window passed a live cursor before the stall rule cut it off
                    yield self._resync(
                        pb.Resync.CAUSE_SUBSCRIBER_OVERFLOW,
                        f"subscriber fell more than {bus.replay_window} events (the replay window) behind: "
                        f"events after {sub.cursor} are no longer kept",
                    )
                    return
                requested = False
                if events:
                    for ev in events if scope is None else scope.visible(events):
                        if flt.matches(ev):
                            sub.cursor = ev.sequence
                            sub.sending_since = loop.time()
                            yield wire.event_bytes(ev, bus.epoch) if scope is None else scope.event_bytes(ev, bus.epoch)
                            sub.sending_since = None
                            last_sent = loop.time()
                            if sub.overflowed:
                                break
                    else:
                        sub.cursor = events[-1].sequence
                    continue
                sub.wake.clear()
                if bus.last_sequence > sub.cursor or self._closing:
                    continue
                # Heartbeat after `heartbeat` seconds without a message to this
                # subscriber, even if filtered-out events kept waking it.
                remaining = last_sent + heartbeat - loop.time()
                if remaining > 0:
                    try:
                        await asyncio.wait_for(sub.wake.wait(), timeout=remaining)
                        continue
                    except asyncio.TimeoutError:
                        pass
                sub.sending_since = loop.time()
                yield self._control(sub.cursor, heartbeat=pb.Heartbeat())
                sub.sending_since = None
                last_sent = loop.time()
        finally:
            self._subs.discard(sub)


def _too_many(message: str, cause: str, limit: int) -> RpcError:
    err = resource_exhausted(f"{message} ({limit}); close a stream first", cause, None)
    err.metadata["limit"] = str(limit)
    return err
