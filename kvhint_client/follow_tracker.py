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
            if _refused_subscription(error):
                self._need_snapshot = True  # the server refused this resume; start over
        if self._staging is not None:
            self._staging = None
            self._need_snapshot = True
        self._connected_live = False
        if self.status.live:
            self.status.live = False
            self.index.set_live(self.engine, False)
        return progressed
