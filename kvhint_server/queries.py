"""Read-side views (QueryResidency, ListSessions, snapshots).

Every function here runs on the engine thread (through KvHintCore.submit), so
what it returns is consistent with the event sequence it reports: the state
reflects exactly the events with sequence <= the returned sequence.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .core import KvHintCore
from .executor import HintExecutor
from .model import RetentionView, Selector, Tier, tiers_of

MAX_SESSIONS_PER_BLOCK = 16


@dataclass(frozen=True, slots=True)
class BlockView:
    block_hash: bytes
    parent: bytes | None
    position: int | None
    tiers: int
    in_use: bool
    retention: RetentionView
    sessions: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class SessionView:
    session_id: str
    parent: str | None
    frontiers: tuple[bytes, ...]
    counts: dict[Tier, int]
    retention: RetentionView
    continuations: tuple[str, ...]
    last_active: float


@dataclass(frozen=True, slots=True)
class Residency:
    blocks: list[BlockView]
    totals: dict[Tier, int]
    sequence: int


@dataclass(frozen=True, slots=True)
class SessionPage:
    sessions: list[SessionView]
    next_after: str | None
    sequence: int


@dataclass(frozen=True, slots=True)
class Snapshot:
    sequence: int
    # (session_id, blocks); session "" holds device blocks of no session.
    chunks: list[tuple[str, list[BlockView]]]


class Queries:
    def __init__(self, core: KvHintCore, executor: HintExecutor) -> None:
        self.core = core
        self.executor = executor

    def block_views(self, hashes: Sequence[bytes]) -> list[BlockView]:
        core = self.core
        index = core.index
        engine = core.adapter.lookup(hashes)
        now = core.monotonic()
        out = []
        for h in hashes:
            node = index.node(h)
            state = engine.get(h)
            tiers = (node.tiers if node is not None else 0) | (state.tiers if state is not None else 0)
            if node is None and state is None:
                continue
            out.append(
                BlockView(
                    block_hash=h,
                    parent=node.parent if node is not None else (state.parent if state else None),
                    position=node.position if node is not None else (state.position if state else None),
                    tiers=tiers,
                    in_use=bool(state and state.in_use),
                    retention=core.ledger.view(h, now),
                    sessions=tuple(sorted(node.sessions))[:MAX_SESSIONS_PER_BLOCK] if node is not None else (),
                )
            )
        return out

    def residency(self, selector: Selector, tier_filter: Iterable[Tier] = ()) -> Residency:
        wanted = 0
        for t in tier_filter:
            wanted |= t.bit
        views = self.block_views(self.executor.resolve(selector))
        if wanted:
            views = [v for v in views if v.tiers & wanted]
        totals: dict[Tier, int] = {}
        for v in views:
            for t in tiers_of(v.tiers):
                if not wanted or t.bit & wanted:
                    totals[t] = totals.get(t, 0) + 1
        return Residency(views, totals, self.core.bus.last_sequence)

    def sessions(self, prefix: str, after: str | None, limit: int) -> SessionPage:
        core = self.core
        index = core.index
        names = sorted(s for s in index.sessions if s.startswith(prefix) and (after is None or s > after))
        page = names[:limit]
        now = core.monotonic()
        views = []
        for s in page:
            state = index.sessions[s]
            views.append(
                SessionView(
                    session_id=s,
                    parent=state.parent,
                    frontiers=tuple(sorted(index.frontiers(s))),
                    counts=index.tier_counts(state.blocks),
                    retention=core.ledger.owner_view("s:" + s, now),
                    continuations=tuple(sorted(state.continuations))[:MAX_SESSIONS_PER_BLOCK],
                    last_active=state.last_active,
                )
            )
        next_after = page[-1] if len(names) > limit else None
        return SessionPage(views, next_after, core.bus.last_sequence)

    def snapshot(self) -> Snapshot:
        """Per-session residency plus the device blocks of no session."""
        core = self.core
        index = core.index
        chunks: list[tuple[str, list[BlockView]]] = []
        for s in sorted(index.sessions):
            chunks.append((s, self.block_views(index.resolve_session(s))))
        anonymous = [b.block_hash for b in core.adapter.device_blocks() if index.node(b.block_hash) is None]
        if anonymous:
            chunks.append(("", self.block_views(anonymous)))
        return Snapshot(core.bus.last_sequence, chunks)
