"""SnapshotCursor: a WatchEvents snapshot taken in bounded slices.

A snapshot of 10k sessions sharing a prefix is ~60k block views; built in one
engine-thread task it stalls serving for as long as it takes. The cursor
instead does a bounded piece per engine step (`KvHintCore.submit_slice`):

  * `begin()` (engine thread, a C-level copy of the resident block list, no
    Python-level work per item) fixes the first work list: every resident
    block (from `core.resident`, all tiers); the second, every live session,
    is copied when the first is done;
  * each `step(deadline)` (engine thread) turns items into views until the
    deadline passes (at least one item, so it always progresses) and returns
    them with the current sequence: the piece is the state at that sequence.

Pieces come in two phases. First the residency of every block resident at
the start (chunks with an empty session id, all tiers), then each session's
member blocks. Whoever streams them (watch.py) sends, before each piece, the
events up to the piece's sequence, so a client applying chunks and events in
stream order ends with the engine state at the last piece's sequence (see the
proto's SnapshotBegin for the wire contract):

  * tier sets: a block resident at the start gets its tiers from its chunk
    (the state at the chunk's sequence, later events applied on top); a block
    first stored after the start gets them from its events;
  * membership: every session chunk comes after the residency phase, so a
    client's tier sets are exact while it applies membership; a session's
    chunk states its membership at the chunk's sequence (events before it that
    concerned the session are subsumed, events after it apply on top). The
    session list is taken when the residency phase ends, so every session
    alive then gets a chunk: membership a client dropped too eagerly while its
    tier sets were still partial (a cache reset of a block whose other copy it
    had not heard of yet) is restated. Sessions that appear later are known
    from their events, applied to exact tier sets.

Items gone by the time they come up (evicted blocks, forgotten sessions) are
skipped: the events that removed them came first.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from .model import Tier
from .queries import BlockView, Queries

# Blocks turned into views between two clock checks.
_BLOCK_BATCH = 32


@dataclass(frozen=True, slots=True)
class SnapshotStart:
    sequence: int
    num_sessions: int
    num_blocks: int


@dataclass(frozen=True, slots=True)
class SnapshotPiece:
    """The state of some blocks or sessions at `sequence`. chunks: (session
    id, views); session "" carries block residency."""

    sequence: int
    chunks: list[tuple[str, list[BlockView]]]
    done: bool


class SnapshotCursor:
    """One snapshot's progress. Engine thread only; one step at a time.

    max_items: at most this many blocks or sessions per step (None: only the
    deadline bounds a step). Tests use it to force many small pieces.
    """

    def __init__(
        self,
        queries: Queries,
        max_items: int | None = None,
        owned: Callable[[str], bool] | None = None,
        sessions: Callable[[str], bool] | None = None,
    ) -> None:
        self._queries = queries
        self._max_items = max_items
        self._owned = owned  # a tenant's view of retention (Queries.block_views)
        # A tenant's snapshot: only the sessions this accepts, and no residency phase
        # (session-less block chunks are not a tenant's to see).
        self._session_filter = sessions
        self._blocks: list[bytes] = []
        self._sessions: list[str] | None = None  # taken when the residency phase ends
        self._next_block = 0
        self._next_session = 0

    def begin(self) -> SnapshotStart:
        core = self._queries.core
        keep = self._session_filter
        if keep is not None:  # a tenant: its sessions now, and the distinct blocks they hold
            index = core.index
            self._sessions = [s for s in index.sessions if keep(s)]
            held: set[bytes] = set().union(*(index.sessions[s].blocks for s in self._sessions))
            return SnapshotStart(core.bus.last_sequence, len(self._sessions), len(held))
        device = core.resident[Tier.DEVICE]
        lower = [held for t, held in core.resident.items() if t is not Tier.DEVICE and held]
        self._blocks = list(device)  # a C-level copy; the set union is for the (smaller) lower tiers
        if lower:
            self._blocks.extend(set().union(*lower) - device.keys())
        return SnapshotStart(core.bus.last_sequence, len(core.index.sessions), len(self._blocks))

    @property
    def done(self) -> bool:
        if self._next_block < len(self._blocks):
            return False
        return self._sessions is not None and self._next_session >= len(self._sessions)

    def step(self, deadline: float) -> SnapshotPiece:
        """One bounded piece: views until `time.perf_counter()` passes
        `deadline` or max_items is reached."""
        core = self._queries.core
        budget = self._max_items if self._max_items is not None else 1 << 62
        chunks: list[tuple[str, list[BlockView]]] = []
        if self._next_block < len(self._blocks):
            budget = self._block_phase(deadline, budget, chunks)
        if self._next_block >= len(self._blocks) and budget > 0:
            self._session_phase(deadline, budget, chunks, first=not chunks)
        return SnapshotPiece(core.bus.last_sequence, chunks, self.done)

    def _block_phase(self, deadline: float, budget: int, chunks: list[tuple[str, list[BlockView]]]) -> int:
        core = self._queries.core
        tiers_of = core.tiers_of
        views: list[BlockView] = []
        blocks = self._blocks
        while self._next_block < len(blocks) and budget > 0:
            end = min(len(blocks), self._next_block + min(_BLOCK_BATCH, budget))
            batch = [h for h in blocks[self._next_block : end] if tiers_of(h)]  # still resident
            budget -= end - self._next_block
            self._next_block = end
            views.extend(self._queries.block_views(batch))  # no tenant gets this phase
            if time.perf_counter() >= deadline:
                budget = 0
        if views:
            chunks.append(("", views))
        return budget

    def _session_phase(
        self, deadline: float, budget: int, chunks: list[tuple[str, list[BlockView]]], first: bool
    ) -> None:
        index = self._queries.core.index
        if self._sessions is None:
            self._sessions = list(index.sessions)
        cache: dict[bytes, BlockView] = {}  # shared prefixes: one view per block per piece
        sessions = self._sessions
        while self._next_session < len(sessions) and budget > 0:
            if not first and time.perf_counter() >= deadline:
                return
            first = False
            session = sessions[self._next_session]
            self._next_session += 1
            budget -= 1
            if session in index.sessions:  # forgotten since: its events said so
                chunks.append((session, self._queries.block_views(index.resolve_session(session), cache, self._owned)))
