"""ResidencyIndex: the router-side session -> engine -> tier -> block hashes index.

Transport-free: this module imports no grpc (nor the client), so a router can embed the index
and feed it from its own watch loop (apply_event / replace / reset / set_live), or let
kvhint_client.follower.EventFollower feed it. kvhint_client.follow_tracker.EngineTracker turns
one engine's WatchEvents stream into these calls.

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
  `include_stale=True`, whether they span engines or name one; a disconnected engine's last
  state is kept for its resume (see ResidencyIndex).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Optional

from kvhint.v1 import kvhint_pb2

from .builders import BlockHashLike, block_hash
from .names import TierLike, parse_tier

__all__ = ["EngineResidency", "EngineResidencyState", "ResidencyIndex", "apply_to_state"]

_DEVICE = kvhint_pb2.TIER_DEVICE


def _tier_of(tier: int) -> int:
    return tier or _DEVICE


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
    your own watch loop through apply_event / replace / reset / set_live).

    Staleness, the same rule for every residency query (engines_for_session, engines_for_block,
    session_residency, sessions, session_blocks, tier_blocks): an engine that is not live (no
    snapshot installed yet, its stream disconnected, or reset by a resync or an epoch change) is
    stale, and its residency is left out, as if it held nothing, unless the query is given
    `include_stale=True`; then the engine's last known state is answered (empty after a reset). A
    query that names an engine follows the rule too (`sessions("e2")` is empty while e2 is not
    live). An engine the index never heard of holds nothing either way. `engines()`, `is_live()`
    and `wait_live()` are about the engines themselves and list stale ones too.
    """

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

    def _state(self, engine: str, include_stale: bool) -> Optional[EngineResidencyState]:
        """`engine`'s state if a query may answer from it (see the class docstring); under the lock."""
        if not include_stale and not self._live.get(engine):
            return None
        return self._states.get(engine)

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
        """Live engines (any engine if include_stale) holding blocks of `session_id`, most blocks
        first (ties: more device blocks, then engine name)."""
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
        """Live engines (any engine if include_stale) where the block is resident (on `tier`, or
        on any tier)."""
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

    def session_blocks(
        self, session_id: str, engine: str, *, tier: Optional[TierLike] = None, include_stale: bool = False
    ) -> frozenset[bytes]:
        """Blocks of `session_id` resident on `engine` (on `tier`, or any tier); empty while
        `engine` is not live unless include_stale."""
        tier_value = None if tier is None else parse_tier(tier)
        with self._lock:
            state = self._state(engine, include_stale)
            return frozenset(state.session_blocks(session_id, tier_value)) if state else frozenset()

    def session_residency(self, session_id: str, *, include_stale: bool = False) -> dict[str, dict[int, frozenset[bytes]]]:
        """engine -> tier -> blocks of `session_id`, for live engines (any engine if
        include_stale) holding some."""
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
        """Session ids with resident blocks on `engine`, or on any engine when None; only live
        engines count unless include_stale (so empty for a named engine that is not live)."""
        with self._lock:
            if engine is None:
                states = [self._states[e] for e in self._engines(include_stale)]
            else:
                state = self._state(engine, include_stale)
                states = [state] if state is not None else []
            return {s for state in states for s in state.sessions}

    def tier_blocks(self, engine: str, tier: TierLike, *, include_stale: bool = False) -> frozenset[bytes]:
        """Every block resident on `engine`'s `tier`; empty while `engine` is not live unless
        include_stale."""
        tier_value = parse_tier(tier)
        with self._lock:
            state = self._state(engine, include_stale)
            return frozenset(state.tiers.get(tier_value, ())) if state else frozenset()


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
