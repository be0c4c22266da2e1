"""EngineTracker: the per-engine WatchEvents stream state machine, transport-free (sans-IO).

It imports no grpc (nor the client): the runners in kvhint_client.follower (thread and asyncio)
own the streams and feed each message to `handle`; a router with its own watch loop can do the
same. It keeps a ResidencyIndex (kvhint_client.residency_index) current and says how to
(re)subscribe.

Stream protocol per engine (kvhint.v1 WatchEvents):
- Subscribe with START_SNAPSHOT: SnapshotBegin, SnapshotChunk..., SnapshotEnd. The server takes
  the snapshot in slices and sends the events that happen meanwhile between the chunks; chunks and
  events are applied in stream order to a state built aside and installed atomically at
  SnapshotEnd, whose `sequence` is the snapshot point.
- Then events: strictly increasing `sequence` within an `epoch`. An event at or below the last
  processed sequence is a duplicate and skipped; heartbeats advance the position.
- After a disconnect (engine down, network), resubscribe with START_RESUME from the last
  (epoch, sequence) processed (`subscription()`), unless the server refused the subscription
  itself (then re-snapshot).
- A Resync message (terminal) or a message from a different epoch discards that engine's state
  and re-snapshots. A snapshot interrupted by a disconnect is dropped and retaken.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Optional

from kvhint.v1 import kvhint_pb2

from .residency_index import EngineResidencyState, ResidencyIndex, apply_to_state

__all__ = ["EngineStatus", "EngineTracker", "Verdict"]

#: The runners' logger, so logging set up for kvhint_client.follower keeps covering these messages.
log = logging.getLogger("kvhint_client.follower")

#: Codes meaning the server rejected the subscription itself, so resuming it again is pointless.
#: grpc.StatusCode member names, compared by name so that this module needs no grpc.
_REFUSED_SUBSCRIPTION = frozenset({"INVALID_ARGUMENT", "FAILED_PRECONDITION", "OUT_OF_RANGE", "NOT_FOUND"})


def _refused_subscription(error: BaseException) -> bool:
    """Whether `error` (the runners pass a KvHintError) carries one of those status codes."""
    return getattr(getattr(error, "code", None), "name", None) in _REFUSED_SUBSCRIPTION


class Verdict(enum.Enum):
    CONTINUE = "continue"
    #: Drop the stream and subscribe again with a snapshot (resync or epoch change).
    RESNAPSHOT = "resnapshot"


@dataclass
class EngineStatus:
    """Counters and position of one followed engine (EventFollower.status() returns the live
    objects; the follower updates them as messages arrive).

    live: a snapshot is installed and the current stream is connected (the index answers for the
        engine; see ResidencyIndex).
    epoch, last_sequence: the position processed (epoch of the last installed snapshot).
    snapshots: snapshots installed. resyncs: Resync messages received (any cause).
    epoch_changes: how many times the follower found the engine in an epoch other than the one it
        last knew (the epoch of its last installed snapshot, or a newer one it was told of since),
        e.g. because the engine restarted. It learns it from whichever comes first: a message
        stamped with another epoch, a Resync naming another current epoch (or with
        CAUSE_EPOCH_CHANGED), or the installed snapshot's epoch (after a resync for another cause,
        or a refused resume). Each change counts once however many of these it sees; the first
        epoch it syncs to is not a change.
    connects: subscriptions made. duplicates_skipped, sequence_gaps: events at or below the
        position, and jumps past position + 1. stalls: streams cancelled for silence.
    last_error: a current error only: the text of the error that ended the latest stream to end
        with one, from then until the engine is next live, when it moves to previous_error and
        last_error becomes None. So `live` implies `last_error is None`; a non-live engine whose
        streams ended without error since it was last live (a resync, an epoch change, a stall,
        stop(), not yet synced) has None too.
    previous_error: the last error cleared by going live again (None if none was): what the
        engine recovered from, for logs and dashboards; not a current error.
    """

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
    previous_error: Optional[str] = None


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
        # The epoch the follower last knew the engine in, for epoch_changes: None until the first
        # snapshot is installed; "" when a Resync said the engine left that epoch without naming
        # the new one.
        self._known_epoch: Optional[str] = None
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
            self._clear_error()
            self.status.live = True
            self.index.set_live(self.engine, True)

    def _clear_error(self) -> None:
        """The engine is live again: its last error is history (before `live` is set, so that a
        reader on another thread never sees a live engine with a current error)."""
        if self.status.last_error is not None:
            self.status.previous_error = self.status.last_error
            self.status.last_error = None

    def _learn_epoch(self, epoch: str) -> None:
        """The engine is in `epoch` ("" when only a Resync's cause said it left the known one)."""
        known = self._known_epoch
        if known is None or epoch == known:
            return  # not synced yet (the first snapshot's epoch is no change), or no news
        if known == "" and epoch:
            self._known_epoch = epoch  # the change announced without a name: already counted
            return
        self.status.epoch_changes += 1
        self._known_epoch = epoch

    def _learn_resync_epoch(self, resync: kvhint_pb2.Resync, envelope_epoch: str) -> None:
        current = resync.current_epoch or envelope_epoch
        if resync.cause == kvhint_pb2.Resync.CAUSE_EPOCH_CHANGED:
            # The server says the engine is not in the epoch resumed from (the known one).
            self._learn_epoch("" if current == self._known_epoch else current)
        elif current:
            self._learn_epoch(current)

    def handle(self, message: kvhint_pb2.WatchEventsResponse) -> Verdict:
        kind = message.WhichOneof("payload")
        if kind == "resync":
            log.info("engine %s: resync (%s); re-snapshotting", self.engine, message.resync.message or message.resync.cause)
            self.status.resyncs += 1
            self._learn_resync_epoch(message.resync, message.epoch)
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
            self._learn_epoch(message.epoch)
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
            if self._known_epoch is None:
                self._known_epoch = message.epoch  # the first epoch synced to: not a change
            else:
                self._learn_epoch(message.epoch)
            self._epoch = message.epoch
            self._last_sequence = message.sequence
            self._need_snapshot = False
            self.index.replace(self.engine, self._staging, live=True)
            self._staging = None
            self._connected_live = True
            self.status.snapshots += 1
            self._clear_error()
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
        if self._staging is not None:
            self._staging = None
            self._need_snapshot = True
        self._connected_live = False
        if self.status.live:
            self.status.live = False
            self.index.set_live(self.engine, False)
        if error is not None:
            self.status.last_error = str(error)  # after `live` was cleared: see _clear_error
            if _refused_subscription(error):
                self._need_snapshot = True  # the server refused this resume; start over
        return progressed
