"""EventBus: epoch + sequence numbered events in a bounded replay ring.

Payloads are NamedTuples: they are built on the engine thread for every block
admission and eviction, and tuples are the cheapest immutable records.

Contract (docs/design.md §6):
  * `epoch` is a nonce minted when the bus is created (engine start).
  * Every published event gets the next `sequence` (1, 2, ...), strictly
    increasing within the epoch.
  * The last `replay_window` events are kept; `read_after(seq)` returns the
    events after `seq`, or None when some of them were already dropped
    (the caller must resync).
  * `publish` never blocks on subscribers: it takes one short lock and pokes
    registered wake hooks, which must be cheap and non-blocking.
  * With tenancy, every event is tagged once, when published, with the tenants
    whose subscriptions may receive it (`Event.tenants`): the publisher's
    explicit tag, or else what `route` (tenant_guard.TenantRouter) derives from
    the payload and its sessions. Subscriptions select by that tag; none of them
    re-derives it.

Publishers run on the engine thread; readers run on the gRPC thread.
"""

from __future__ import annotations

import enum
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .index import LeaveCause
from .model import HintResult, RemovalCause, Tier


class EventKind(enum.IntEnum):
    BLOCKS_STORED = 1
    BLOCKS_REMOVED = 2
    TIER_TRANSFER_COMPLETED = 3
    PIN_BROKEN = 4
    HINT_APPLIED = 5
    OPERATION_COMPLETED = 6
    ALL_BLOCKS_CLEARED = 7
    MEMBERSHIP_CHANGED = 8


class Coordinates(NamedTuple):
    session_id: str = ""
    continuation_id: str = ""
    members: tuple[str, ...] = ()


NO_COORDINATES = Coordinates()


class BlocksStored(NamedTuple):
    tier: Tier
    medium: str
    block_hashes: tuple[bytes, ...]
    parent: bytes | None
    first_position: int
    block_size: int
    coordinates: Coordinates
    prefix_hit: bool = False


class BlocksRemoved(NamedTuple):
    tier: Tier
    medium: str
    block_hashes: tuple[bytes, ...]
    prefix_tokens: tuple[int, ...]
    coordinates: Coordinates
    cause: RemovalCause
    last_copy: bool


class TierTransferCompleted(NamedTuple):
    from_tier: Tier
    to_tier: Tier
    block_hashes: tuple[bytes, ...]
    bytes_moved: int
    operation_id: str
    coordinates: Coordinates


class PinBroken(NamedTuple):
    block_hashes: tuple[bytes, ...]
    session_ids: tuple[str, ...]
    shortfall_blocks: int
    # With tenancy: (tenant name, the blocks whose broken grants were that tenant's), one entry
    # per tenant that held any (session, continuation or block-hash grants alike). A tenant's
    # subscription is shown its own blocks alone (tenant_guard.WatchScope.event_bytes).
    tenant_blocks: tuple[tuple[str, tuple[bytes, ...]], ...] = ()


class HintApplied(NamedTuple):
    hint: Any  # the wire Hint message, as received
    result: HintResult
    # The result's pb.HintResult, converted once by the executor for both the
    # ApplyHints response and this event (None: converted when sent).
    message: Any = None
    # The tenant that sent the hint ("" without tenancy or from an admin): with tenancy, its
    # subscriptions alone get the event (tenant_guard.WatchScope), whatever the selector names.
    scope: str = ""


class OperationCompleted(NamedTuple):
    operation: Any  # operations.Operation


class AllBlocksCleared(NamedTuple):
    tier: Tier


class MembershipChanged(NamedTuple):
    """`session_id` left `block_hashes` (chain order), which stay resident:
    the session is gone from the index (Release, index size cap)."""

    session_id: str
    block_hashes: tuple[bytes, ...]
    cause: LeaveCause


Payload = (
    BlocksStored
    | BlocksRemoved
    | TierTransferCompleted
    | PinBroken
    | HintApplied
    | OperationCompleted
    | AllBlocksCleared
    | MembershipChanged
)

_KIND_OF: dict[type, EventKind] = {
    BlocksStored: EventKind.BLOCKS_STORED,
    BlocksRemoved: EventKind.BLOCKS_REMOVED,
    TierTransferCompleted: EventKind.TIER_TRANSFER_COMPLETED,
    PinBroken: EventKind.PIN_BROKEN,
    HintApplied: EventKind.HINT_APPLIED,
    OperationCompleted: EventKind.OPERATION_COMPLETED,
    AllBlocksCleared: EventKind.ALL_BLOCKS_CLEARED,
    MembershipChanged: EventKind.MEMBERSHIP_CHANGED,
}


@dataclass(slots=True)
class Event:
    sequence: int
    time: float
    kind: EventKind
    payload: Payload
    # For filtering: sessions the event concerns, and its tier (None: no tier).
    sessions: tuple[str, ...]
    tier: Tier | None
    # With tenancy: the tenants whose subscriptions may receive it, tagged once when published
    # (None: not tagged, no tenancy; such an event reaches no tenant's subscription).
    tenants: frozenset[str] | None = None
    # Serialized wire form, built once on first delivery (gRPC thread only).
    wire: bytes | None = field(default=None, compare=False)
    # A tenant's view of the wire form when it differs (foreign ids cut), built once per tenant
    # on first delivery (gRPC thread only; tenant_guard.WatchScope.event_bytes).
    views: dict[str, bytes] | None = field(default=None, compare=False)


class EventBus:
    def __init__(self, replay_window: int, clock: Callable[[], float] = time.time) -> None:
        if replay_window <= 0:
            raise ValueError("replay_window must be positive")
        self.epoch = secrets.token_hex(8)
        self.replay_window = replay_window
        self._clock = clock
        self._ring: list[Event | None] = [None] * replay_window
        self._last = 0
        self._lock = threading.Lock()
        self._wake_hooks: list[Callable[[], None]] = []
        # With tenancy: route(payload, sessions) -> the tenants an untagged event reaches
        # (tenant_guard.TenantRouter, set by the core); None: events are not tagged.
        self.route: Callable[[Payload, tuple[str, ...]], frozenset[str]] | None = None

    @property
    def last_sequence(self) -> int:
        return self._last

    @property
    def oldest_sequence(self) -> int:
        """The oldest sequence still kept (last + 1 when nothing is kept)."""
        return max(1, self._last - self.replay_window + 1)

    def add_wake_hook(self, hook: Callable[[], None]) -> None:
        self._wake_hooks.append(hook)

    def remove_wake_hook(self, hook: Callable[[], None]) -> None:
        if hook in self._wake_hooks:
            self._wake_hooks.remove(hook)

    def publish(
        self, payload: Payload, sessions: Sequence[str] = (), tier: Tier | None = None, tenants: frozenset[str] | None = None
    ) -> int:
        """Append an event. `tenants`: its tenant tag when the publisher knows more than its
        sessions tell (see the module docstring); otherwise `route` derives it."""
        now = self._clock()
        sessions = tuple(sessions)
        if tenants is None and self.route is not None:
            tenants = self.route(payload, sessions)
        with self._lock:
            self._last += 1
            seq = self._last
            self._ring[seq % self.replay_window] = Event(seq, now, _KIND_OF[type(payload)], payload, sessions, tier, tenants)
        for hook in self._wake_hooks:
            hook()
        return seq

    def read_after(self, sequence: int, limit: int) -> list[Event] | None:
        """Events with sequence in (sequence, sequence + limit], oldest first.

        Returns None if any event after `sequence` was already dropped from
        the ring (the reader fell out of the replay window).
        """
        with self._lock:
            last = self._last
            if sequence >= last:
                return []
            if sequence + 1 < self.oldest_sequence:
                return None
            end = min(last, sequence + limit)
            ring, n = self._ring, self.replay_window
            return [ring[s % n] for s in range(sequence + 1, end + 1)]  # type: ignore[misc]
