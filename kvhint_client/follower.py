"""EventFollower: keeps a router-side ResidencyIndex current from one or more engines' WatchEvents.

    follower = EventFollower({"e1": "10.0.0.1:50151", "e2": "10.0.0.2:50151"})
    follower.start()
    follower.wait_synced(timeout=10)
    best = follower.index.engines_for_session("agent-7")   # ranked, most resident blocks first

Stream protocol per engine (kvhint.v1 WatchEvents):
- Subscribe with START_SNAPSHOT: SnapshotBegin, SnapshotChunk..., SnapshotEnd. The server takes
  the snapshot in slices and sends the events that happen meanwhile between the chunks; chunks and
  events are applied in stream order to a state built aside and installed atomically at
  SnapshotEnd, whose `sequence` is the snapshot point.
- Then events: strictly increasing `sequence` within an `epoch`. An event at or below the last
  processed sequence is a duplicate and skipped; heartbeats advance the position.
- After a disconnect (engine down, network), resubscribe with START_RESUME from the last
  (epoch, sequence) processed, with exponential backoff while the engine is unreachable.
- A Resync message (terminal) or a message from a different epoch discards that engine's state
  and re-snapshots. A snapshot interrupted by a disconnect is dropped and retaken.
- A stream silent for longer than `stall_timeout` (default 5 heartbeats + 1 s; heartbeats are
  requested from the server) is treated as a dead connection: cancelled and resumed.

Index semantics (the server's, see MembershipChanged in kvhint.proto; at every quiescent point
the index agrees with the engine's QueryResidency and ListSessions, session by session and tier
by tier):
- BlocksStored(tier, hashes, coordinates) makes the hashes resident on that tier and members of
  coordinates.session_id (prefix_hit=true establishes membership the same way).
  coordinates.member_session_ids is informational (capped at 16): every member joined by its own
  BlocksStored.
- BlocksRemoved(tier, hashes) removes them from that tier; with last_copy=true the blocks are
  resident nowhere on that engine and leave every session.
- AllBlocksCleared(tier) empties the tier; blocks left on no tier leave every session.
- MembershipChanged(session, hashes) takes the session off those blocks (a Release of the
  session, or the server's index cap); the blocks stay resident.
- A session with no block left is gone. TIER_UNSPECIFIED on these events means the device tier.
- Other events (transfer completed, pin broken, hint applied, operation completed) carry no
  residency or membership of their own (the engine reports the copies as BlocksStored /
  BlocksRemoved); they reach `on_event` only. Protection (retain/pin) is not tracked here: ask
  QueryResidency, or watch HintApplied / PinBroken.
- Queries answer from *live* engines only (snapshot installed and stream connected) unless
  `include_stale=True`; a disconnected engine's last state is kept for its resume.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import grpc

from kvhint.v1 import kvhint_pb2

from .builders import BlockHashLike, block_hash
from .client import AsyncKvHintClient, KvHintClient, WatchStream
from .config import ConfigLike, ConnectionConfig, RetryPolicy, as_config
from .errors import KvHintError
from .names import TierLike, parse_tier

log = logging.getLogger(__name__)

EventCallback = Callable[[str, kvhint_pb2.WatchEventsResponse], None]
EnginesLike = Union[Mapping[str, ConfigLike], Iterable[ConfigLike]]

_DEVICE = kvhint_pb2.TIER_DEVICE


def _tier_of(tier: int) -> int:
    return tier or _DEVICE


# ---------------------------------------------------------------------------------------------
# Index
# ---------------------------------------------------------------------------------------------


class EngineResidencyState:
    """One engine's residency: tier -> hashes, and session <-> hash membership. Not thread-safe;
    ResidencyIndex guards it."""

    __slots__ = ("tiers", "members", "sessions", "tiers_exact")

    def __init__(self, tiers_exact: bool = True) -> None:
        self.tiers: dict[int, set[bytes]] = {}
        self.members: dict[bytes, set[str]] = {}
        self.sessions: dict[str, set[bytes]] = {}
        # False while a snapshot's residency chunks are still coming: a block missing from `tiers`
        # may still be resident, so only BlocksRemoved.last_copy says a copy was the last.
        self.tiers_exact = tiers_exact

    def resident(self, block: bytes) -> bool:
        return any(block in hashes for hashes in self.tiers.values())

    def store(self, tier: int, hashes: Iterable[bytes], sessions: Iterable[str]) -> None:
        hashes = list(hashes)
        self.tiers.setdefault(_tier_of(tier), set()).update(hashes)
        for session_id in sessions:
            if not session_id:
                continue
            self.sessions.setdefault(session_id, set()).update(hashes)
            for block in hashes:
                self.members.setdefault(block, set()).add(session_id)

    def remove(self, tier: int, hashes: Iterable[bytes], last_copy: bool = False) -> None:
        """The copies on `tier` are gone. A block leaves every session when last_copy
        (BlocksRemoved.last_copy) says so, or when this state knows of no other copy."""
        bucket = self.tiers.get(_tier_of(tier))
        for block in hashes:
            if bucket is not None:
                bucket.discard(block)
            if last_copy or (self.tiers_exact and not self.resident(block)):
                self._forget(block)
        if bucket is not None and not bucket:
            del self.tiers[_tier_of(tier)]

    def leave(self, session_id: str, hashes: Iterable[bytes]) -> None:
        """`session_id` is no longer a member of `hashes` (which stay resident)."""
        blocks = self.sessions.get(session_id)
        if blocks is None:
            return
        for block in hashes:
            blocks.discard(block)
            members = self.members.get(block)
            if members is not None:
                members.discard(session_id)
                if not members:
                    del self.members[block]
        if not blocks:
            del self.sessions[session_id]

    def clear(self, tier: int) -> None:
        for block in self.tiers.pop(_tier_of(tier), set()):
            if not self.resident(block):
                self._forget(block)

    def _forget(self, block: bytes) -> None:
        for session_id in self.members.pop(block, set()):
            blocks = self.sessions.get(session_id)
            if blocks is not None:
                blocks.discard(block)
                if not blocks:
                    del self.sessions[session_id]

    def add_snapshot_chunk(self, chunk: kvhint_pb2.SnapshotChunk) -> None:
        """Residency (every chunk) and the chunk's session's membership; BlockInfo.session_ids is a
        capped, informational list (each member has its own chunk)."""
        sessions = [chunk.session_id]
        if chunk.session_id:
            self.tiers_exact = True  # session chunks come after every residency chunk
        for info in chunk.blocks:
            for tier in info.tiers:
                self.store(tier, [info.block_hash], sessions)

    def session_blocks(self, session_id: str, tier: Optional[int]) -> set[bytes]:
        blocks = self.sessions.get(session_id, set())
        if tier is None:
            return set(blocks)
        return blocks & self.tiers.get(tier, set())


@dataclass(frozen=True)
class EngineResidency:
    """How much of a session one engine holds: `blocks` on the queried tier (any tier when none
    was given), and per tier."""

    engine: str
    blocks: int
    by_tier: dict[int, int] = field(default_factory=dict)


class ResidencyIndex:
    """Thread-safe session -> engine -> tier -> block hashes index, fed by EventFollower (or by
    your own watch loop through apply_event / replace / reset / set_live)."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._states: dict[str, EngineResidencyState] = {}
        self._live: dict[str, bool] = {}

    # -- mutation -------------------------------------------------------------------------------

    def add_engine(self, engine: str) -> None:
        with self._lock:
            self._states.setdefault(engine, EngineResidencyState())
            self._live.setdefault(engine, False)

    def replace(self, engine: str, state: EngineResidencyState, *, live: bool = True) -> None:
        """Install a complete state (a finished snapshot) for `engine`."""
        with self._lock:
            self._states[engine] = state
            self._live[engine] = live
            self._lock.notify_all()

    def reset(self, engine: str) -> None:
        """Discard `engine`'s state (resync / epoch change); it is not live until re-snapshotted."""
        with self._lock:
            self._states[engine] = EngineResidencyState()
            self._live[engine] = False
            self._lock.notify_all()

    def set_live(self, engine: str, live: bool) -> None:
        with self._lock:
            self._states.setdefault(engine, EngineResidencyState())
            self._live[engine] = live
            self._lock.notify_all()

    def apply_event(self, engine: str, message: kvhint_pb2.WatchEventsResponse) -> bool:
        """Apply one residency event; False for messages that carry no residency change."""
        kind = message.WhichOneof("payload")
        with self._lock:
            state = self._states.setdefault(engine, EngineResidencyState())
            return apply_to_state(state, message, kind)

    # -- queries --------------------------------------------------------------------------------

    def _engines(self, include_stale: bool) -> list[str]:
        return [e for e in self._states if include_stale or self._live.get(e)]

    def engines(self) -> list[str]:
        """Every engine the index has heard of."""
        with self._lock:
            return sorted(self._states)

    def is_live(self, engine: str) -> bool:
        with self._lock:
            return bool(self._live.get(engine))

    def wait_live(self, engines: Iterable[str], timeout: Optional[float] = None) -> bool:
        """Block until every engine in `engines` is live; False on timeout."""
        wanted = list(engines)
        with self._lock:
            return self._lock.wait_for(lambda: all(self._live.get(e) for e in wanted), timeout)

    def engines_for_session(
        self, session_id: str, *, tier: Optional[TierLike] = None, include_stale: bool = False
    ) -> list[EngineResidency]:
        """Engines holding blocks of `session_id`, most blocks first (ties: more device blocks,
        then engine name)."""
        tier_value = None if tier is None else parse_tier(tier)
        ranked = []
        with self._lock:
            for engine in self._engines(include_stale):
                state = self._states[engine]
                blocks = state.session_blocks(session_id, tier_value)
                if not blocks:
                    continue
                by_tier = {t: len(blocks & hashes) for t, hashes in state.tiers.items() if blocks & hashes}
                ranked.append(EngineResidency(engine, len(blocks), by_tier))
        ranked.sort(key=lambda r: (-r.blocks, -r.by_tier.get(_DEVICE, 0), r.engine))
        return ranked

    def engines_for_block(
        self, block: BlockHashLike, *, tier: Optional[TierLike] = None, include_stale: bool = False
    ) -> set[str]:
        """Engines where the block is resident (on `tier`, or on any tier)."""
        raw = block_hash(block)
        tier_value = None if tier is None else parse_tier(tier)
        with self._lock:
            found = set()
            for engine in self._engines(include_stale):
                tiers = self._states[engine].tiers
                if tier_value is None:
                    if any(raw in hashes for hashes in tiers.values()):
                        found.add(engine)
                elif raw in tiers.get(tier_value, ()):
                    found.add(engine)
            return found

    def session_blocks(self, session_id: str, engine: str, *, tier: Optional[TierLike] = None) -> frozenset[bytes]:
        """Blocks of `session_id` resident on `engine` (on `tier`, or any tier). Answers for stale
        engines too (the caller named the engine)."""
        tier_value = None if tier is None else parse_tier(tier)
        with self._lock:
            state = self._states.get(engine)
            return frozenset(state.session_blocks(session_id, tier_value)) if state else frozenset()

    def session_residency(self, session_id: str, *, include_stale: bool = False) -> dict[str, dict[int, frozenset[bytes]]]:
        """engine -> tier -> blocks of `session_id`."""
        out: dict[str, dict[int, frozenset[bytes]]] = {}
        with self._lock:
            for engine in self._engines(include_stale):
                state = self._states[engine]
                blocks = state.sessions.get(session_id)
                if not blocks:
                    continue
                out[engine] = {t: frozenset(blocks & h) for t, h in state.tiers.items() if blocks & h}
        return out

    def sessions(self, engine: Optional[str] = None, *, include_stale: bool = False) -> set[str]:
        """Session ids with resident blocks (on `engine`, or on any live engine)."""
        with self._lock:
            engines = [engine] if engine is not None else self._engines(include_stale)
            return {s for e in engines if e in self._states for s in self._states[e].sessions}

    def tier_blocks(self, engine: str, tier: TierLike) -> frozenset[bytes]:
        """Every block resident on `engine`'s `tier`."""
        with self._lock:
            state = self._states.get(engine)
            return frozenset(state.tiers.get(parse_tier(tier), ())) if state else frozenset()


def apply_to_state(state: EngineResidencyState, message: kvhint_pb2.WatchEventsResponse, kind: Optional[str]) -> bool:
    if kind == "blocks_stored":
        stored = message.blocks_stored
        coords = stored.coordinates
        state.store(stored.tier, stored.block_hashes, [coords.session_id])
        return True
    if kind == "blocks_removed":
        removed = message.blocks_removed
        state.remove(removed.tier, removed.block_hashes, removed.last_copy)
        return True
    if kind == "membership_changed":
        changed = message.membership_changed
        state.leave(changed.session_id, changed.block_hashes)
        return True
    if kind == "all_blocks_cleared":
        state.clear(message.all_blocks_cleared.tier)
        return True
    return False


# ---------------------------------------------------------------------------------------------
# Per-engine stream state machine (transport-free; shared by the thread and asyncio followers)
# ---------------------------------------------------------------------------------------------


class Verdict(enum.Enum):
    CONTINUE = "continue"
    #: Drop the stream and subscribe again with a snapshot (resync or epoch change).
    RESNAPSHOT = "resnapshot"


@dataclass
class EngineStatus:
    """Counters and position of one followed engine."""

    engine: str
    address: str
    live: bool = False
    epoch: str = ""
    last_sequence: int = 0
    snapshots: int = 0
    resyncs: int = 0
    epoch_changes: int = 0
    connects: int = 0
    duplicates_skipped: int = 0
    sequence_gaps: int = 0
    stalls: int = 0
    last_error: Optional[str] = None


class EngineTracker:
    """Turns one engine's WatchEvents messages into ResidencyIndex updates and decides how to
    (re)subscribe. One tracker per engine; not thread-safe (one stream at a time)."""

    def __init__(self, engine: str, address: str, index: ResidencyIndex) -> None:
        self.engine = engine
        self.index = index
        self.status = EngineStatus(engine, address)
        self._epoch: Optional[str] = None
        self._last_sequence = 0
        self._need_snapshot = True
        self._staging: Optional[EngineResidencyState] = None
        self._connected_live = False
        index.add_engine(engine)

    @property
    def position(self) -> Optional[tuple[str, int]]:
        """(epoch, last sequence processed), once a snapshot was installed."""
        return None if self._epoch is None else (self._epoch, self._last_sequence)

    def subscription(self) -> tuple[str, Optional[tuple[str, int]]]:
        """The (start, resume) to subscribe with next."""
        self.status.connects += 1
        self._connected_live = False
        self._staging = None
        if self._need_snapshot or self._epoch is None:
            self._need_snapshot = True
            return "snapshot", None
        return "resume", (self._epoch, self._last_sequence)

    def _discard(self) -> None:
        self._epoch = None
        self._last_sequence = 0
        self._need_snapshot = True
        self._staging = None
        self.index.reset(self.engine)
        self.status.live = False

    def _go_live(self) -> None:
        if not self._connected_live:
            self._connected_live = True
            self.status.live = True
            self.index.set_live(self.engine, True)

    def handle(self, message: kvhint_pb2.WatchEventsResponse) -> Verdict:
        kind = message.WhichOneof("payload")
        if kind == "resync":
            log.info("engine %s: resync (%s); re-snapshotting", self.engine, message.resync.message or message.resync.cause)
            self.status.resyncs += 1
            self._discard()
            return Verdict.RESNAPSHOT

        if kind == "snapshot_begin":
            self._staging = EngineResidencyState(tiers_exact=False)
            return Verdict.CONTINUE
        if self._staging is not None:
            return self._handle_snapshot_part(message, kind)
        if self._need_snapshot:
            return Verdict.CONTINUE  # nothing before SnapshotBegin counts

        if message.epoch != self._epoch:
            log.info("engine %s: epoch changed %s -> %s; re-snapshotting", self.engine, self._epoch, message.epoch)
            self.status.epoch_changes += 1
            self._discard()
            return Verdict.RESNAPSHOT

        if kind == "heartbeat":
            self._advance(message.sequence)
            self._go_live()
            return Verdict.CONTINUE
        if message.sequence <= self._last_sequence:
            self.status.duplicates_skipped += 1
            self._go_live()
            return Verdict.CONTINUE
        if message.sequence > self._last_sequence + 1:
            self.status.sequence_gaps += 1
        self.index.apply_event(self.engine, message)
        self._advance(message.sequence)
        self._go_live()
        return Verdict.CONTINUE

    def _handle_snapshot_part(self, message: kvhint_pb2.WatchEventsResponse, kind: Optional[str]) -> Verdict:
        assert self._staging is not None
        if kind == "snapshot_chunk":
            self._staging.add_snapshot_chunk(message.snapshot_chunk)
        elif kind == "snapshot_end":
            self._staging.tiers_exact = True
            self._epoch = message.epoch
            self._last_sequence = message.sequence
            self._need_snapshot = False
            self.index.replace(self.engine, self._staging, live=True)
            self._staging = None
            self._connected_live = True
            self.status.snapshots += 1
            self.status.live = True
            self.status.epoch, self.status.last_sequence = message.epoch, message.sequence
        elif kind != "heartbeat":
            apply_to_state(self._staging, message, kind)
        return Verdict.CONTINUE

    def _advance(self, sequence: int) -> None:
        if sequence > self._last_sequence:
            self._last_sequence = sequence
            self.status.last_sequence = sequence
        self.status.epoch = self._epoch or ""

    def stream_ended(self, error: Optional[BaseException] = None) -> bool:
        """The stream closed. Returns whether it made progress (went live) before closing."""
        progressed = self._connected_live
        if error is not None:
            self.status.last_error = str(error)
            if isinstance(error, KvHintError) and error.code in _REFUSED_SUBSCRIPTION:
                self._need_snapshot = True  # the server refused this resume; start over
        if self._staging is not None:
            self._staging = None
            self._need_snapshot = True
        self._connected_live = False
        if self.status.live:
            self.status.live = False
            self.index.set_live(self.engine, False)
        return progressed


#: Codes meaning the server rejected the subscription itself, so resuming it again is pointless.
_REFUSED_SUBSCRIPTION = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.NOT_FOUND,
})


def _named_engines(engines: EnginesLike) -> dict[str, ConnectionConfig]:
    if isinstance(engines, Mapping):
        named = {str(name): as_config(cfg) for name, cfg in engines.items()}
    else:
        named = {}
        for item in engines:
            cfg = as_config(item)
            named[cfg.address] = cfg
    if not named:
        raise ValueError("EventFollower needs at least one engine")
    return named


def _stall_timeout(value: Optional[float], heartbeat: float) -> float:
    if value is None:
        return 5 * heartbeat + 1.0
    if value < 0:
        raise ValueError("stall_timeout must be >= 0")
    return value


#: Sleep between reconnects: 0.1 s doubling to 0.5 s. With the channel's own reconnect backoff
#: capped at 0.5 s (kvhint_client.config.RECONNECT_CHANNEL_OPTIONS) a follower is back in the new
#: epoch within about a second of a restarted engine answering SERVING; a reconnect costs a
#: refused TCP connect, so polling a down engine twice a second is cheap.
DEFAULT_RECONNECT = RetryPolicy(max_attempts=1_000_000, initial_backoff=0.1, max_backoff=0.5, multiplier=2.0, jitter=0.2)


# ---------------------------------------------------------------------------------------------
# Thread follower
# ---------------------------------------------------------------------------------------------


class _FollowerBase:
    """What the thread and asyncio followers share: engines, index, trackers, settings."""

    def __init__(
        self,
        engines: EnginesLike,
        index: Optional[ResidencyIndex],
        heartbeat: float,
        reconnect: RetryPolicy,
        on_event: Optional[EventCallback],
        stall_timeout: Optional[float],
    ) -> None:
        self.index = index or ResidencyIndex()
        self._configs = _named_engines(engines)
        self._heartbeat = heartbeat
        self._reconnect = reconnect
        self._on_event = on_event
        self._stall_timeout = _stall_timeout(stall_timeout, heartbeat)
        self._trackers = {name: EngineTracker(name, cfg.address, self.index) for name, cfg in self._configs.items()}

    @property
    def engines(self) -> list[str]:
        return list(self._configs)

    def status(self) -> dict[str, EngineStatus]:
        return {name: tracker.status for name, tracker in self._trackers.items()}


class EventFollower(_FollowerBase):
    """Follows several engines, one daemon thread each, into `index`.

    engines: {name: address or ConnectionConfig}, or a list of them (named by address).
    heartbeat: the heartbeat period requested from servers (seconds).
    reconnect: backoff between reconnects (max_attempts is ignored; it retries until stop()).
    on_event: called as on_event(engine, message) for every message, on the engine's thread,
        after the index was updated. Exceptions from it are logged and ignored.
    stall_timeout: seconds without any message after which a stream is cancelled and resumed
        (default 5 * heartbeat + 1; 0 disables).
    """

    def __init__(
        self,
        engines: EnginesLike,
        *,
        index: Optional[ResidencyIndex] = None,
        heartbeat: float = 1.0,
        reconnect: RetryPolicy = DEFAULT_RECONNECT,
        on_event: Optional[EventCallback] = None,
        stall_timeout: Optional[float] = None,
    ) -> None:
        super().__init__(engines, index, heartbeat, reconnect, on_event, stall_timeout)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._streams: dict[str, WatchStream] = {}
        self._last_seen: dict[str, float] = {}
        self._streams_lock = threading.Lock()


    def position(self, engine: str) -> Optional[tuple[str, int]]:
        return self._trackers[engine].position

    def start(self) -> "EventFollower":
        if self._threads:
            raise RuntimeError("EventFollower already started")
        self._stop.clear()
        for name in self._configs:
            thread = threading.Thread(target=self._run, args=(name,), name=f"kvhint-follow-{name}", daemon=True)
            self._threads.append(thread)
        if self._stall_timeout:
            self._threads.append(threading.Thread(target=self._watchdog, name="kvhint-follow-watchdog", daemon=True))
        for thread in self._threads:
            thread.start()
        return self

    def wait_synced(self, timeout: Optional[float] = None) -> bool:
        """Block until every engine is live (snapshot installed, stream up); False on timeout."""
        return self.index.wait_live(self._configs, timeout)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop following: cancel every stream and join the threads."""
        self._stop.set()
        with self._streams_lock:
            for stream in self._streams.values():
                stream.cancel()
        for thread in self._threads:
            thread.join(timeout)
        self._threads = []

    def __enter__(self) -> "EventFollower":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _notify(self, engine: str, message: kvhint_pb2.WatchEventsResponse) -> None:
        if self._on_event is None:
            return
        try:
            self._on_event(engine, message)
        except Exception:
            log.exception("on_event callback failed for engine %s", engine)

    def _watchdog(self) -> None:
        """Cancel streams that went silent for longer than stall_timeout (they are then resumed)."""
        assert self._stall_timeout
        while not self._stop.wait(min(1.0, self._stall_timeout / 4)):
            now = time.monotonic()
            with self._streams_lock:
                for engine, stream in self._streams.items():
                    if now - self._last_seen.get(engine, now) > self._stall_timeout:
                        log.info("engine %s: no message for %.1fs; reconnecting", engine, self._stall_timeout)
                        self._trackers[engine].status.stalls += 1
                        self._last_seen[engine] = now
                        stream.cancel()

    def _run(self, engine: str) -> None:
        tracker = self._trackers[engine]
        unproductive = 0
        with KvHintClient(self._configs[engine]) as client:
            while not self._stop.is_set():
                start, resume = tracker.subscription()
                error: Optional[BaseException] = None
                stream = client.watch(start, resume=resume, heartbeat=self._heartbeat)
                with self._streams_lock:
                    self._streams[engine] = stream
                    self._last_seen[engine] = time.monotonic()
                if self._stop.is_set():
                    stream.cancel()
                try:
                    for message in stream:
                        self._last_seen[engine] = time.monotonic()
                        verdict = tracker.handle(message)
                        self._notify(engine, message)
                        if verdict is Verdict.RESNAPSHOT:
                            break
                except KvHintError as exc:
                    error = exc
                    log.debug("engine %s stream failed: %s", engine, exc)
                finally:
                    stream.cancel()
                    with self._streams_lock:
                        self._streams.pop(engine, None)
                progressed = tracker.stream_ended(error)
                unproductive = 0 if progressed else unproductive + 1
                self._stop.wait(self._reconnect.backoff(unproductive + 1))


# ---------------------------------------------------------------------------------------------
# asyncio follower
# ---------------------------------------------------------------------------------------------


class AsyncEventFollower(_FollowerBase):
    """asyncio twin of EventFollower: one task per engine, same index and semantics.
    `await start()` inside a running loop; `await stop()` to cancel."""

    def __init__(
        self,
        engines: EnginesLike,
        *,
        index: Optional[ResidencyIndex] = None,
        heartbeat: float = 1.0,
        reconnect: RetryPolicy = DEFAULT_RECONNECT,
        on_event: Optional[EventCallback] = None,
        stall_timeout: Optional[float] = None,
    ) -> None:
        super().__init__(engines, index, heartbeat, reconnect, on_event, stall_timeout)
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False


    async def start(self) -> "AsyncEventFollower":
        if self._tasks:
            raise RuntimeError("AsyncEventFollower already started")
        self._stopping = False
        self._tasks = [asyncio.create_task(self._run(name), name=f"kvhint-follow-{name}") for name in self._configs]
        return self

    async def wait_synced(self, timeout: Optional[float] = None, poll: float = 0.02) -> bool:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while not all(self.index.is_live(e) for e in self._configs):
            if deadline is not None and loop.time() >= deadline:
                return False
            await asyncio.sleep(poll)
        return True

    async def stop(self) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def __aenter__(self) -> "AsyncEventFollower":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _run(self, engine: str) -> None:
        tracker = self._trackers[engine]
        unproductive = 0
        async with AsyncKvHintClient(self._configs[engine]) as client:
            while not self._stopping:
                start, resume = tracker.subscription()
                error: Optional[BaseException] = None
                stream = client.watch(start, resume=resume, heartbeat=self._heartbeat)
                messages = stream.__aiter__()
                try:
                    while True:
                        try:
                            message = await asyncio.wait_for(anext(messages), self._stall_timeout or None)
                        except StopAsyncIteration:
                            break
                        except asyncio.TimeoutError:
                            log.info("engine %s: no message for %.1fs; reconnecting", engine, self._stall_timeout)
                            tracker.status.stalls += 1
                            break
                        verdict = tracker.handle(message)
                        if self._on_event is not None:
                            try:
                                self._on_event(engine, message)
                            except Exception:
                                log.exception("on_event callback failed for engine %s", engine)
                        if verdict is Verdict.RESNAPSHOT:
                            break
                except KvHintError as exc:
                    error = exc
                finally:
                    stream.cancel()
                progressed = tracker.stream_ended(error)
                unproductive = 0 if progressed else unproductive + 1
                await asyncio.sleep(self._reconnect.backoff(unproductive + 1))
