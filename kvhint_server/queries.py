"""Read-side views (QueryResidency, ListSessions, and the block views that
snapshots are made of: see snapshot.py).

Every function here runs on the engine thread (through KvHintCore.submit), so
what it returns is consistent with the event sequence it reports: the state
reflects exactly the events with sequence <= the returned sequence.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from . import resolution
from .index import MAX_MEMBERS_REPORTED
from .model import RetentionView, Selector, Tier, session_owner, tiers_of

if TYPE_CHECKING:
    from .core import KvHintCore


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


class Queries:
    def __init__(self, core: KvHintCore) -> None:
        self.core = core

    def block_views(
        self, hashes: Sequence[bytes], cache: dict[bytes, BlockView] | None = None, owned: Callable[[str], bool] | None = None
    ) -> list[BlockView]:
        """Views of the blocks that are tracked or resident (others are left
        out), in the given order. `cache` (views computed earlier in the same
        engine step) is read and filled. `owned`: the retention shown is what
        the grants of the owners it accepts give (a tenant's view), not the
        effective class."""
        core = self.core
        index = core.index
        if cache:
            missing = [h for h in hashes if h not in cache]
            engine = core.adapter.lookup(missing) if missing else {}
        else:
            engine = core.adapter.lookup(hashes)
        now = core.monotonic()
        out = []
        for h in hashes:
            if cache is not None and (view := cache.get(h)) is not None:
                out.append(view)
                continue
            node = index.node(h)
            state = engine.get(h)
            tiers = (node.tiers if node is not None else 0) | (state.tiers if state is not None else 0)
            if node is None and state is None:
                continue
            view = BlockView(
                block_hash=h,
                parent=node.parent if node is not None else (state.parent if state else None),
                position=node.position if node is not None else (state.position if state else None),
                tiers=tiers,
                in_use=bool(state and state.in_use),
                retention=core.ledger.view(h, now) if owned is None else core.ledger.view_of(h, now, owned),
                # O(cap), not a sort of a widely shared block's member set.
                sessions=tuple(sorted(index.members(h, MAX_MEMBERS_REPORTED))) if node is not None else (),
            )
            if cache is not None:
                cache[h] = view
            out.append(view)
        return out

    def residency(self, selector: Selector, tier_filter: Iterable[Tier] = ()) -> Residency:
        wanted = 0
        for t in tier_filter:
            wanted |= t.bit
        views = self.block_views(resolution.resolve(self.core, selector))
        if wanted:  # each block reports the wanted tiers only, as the totals count them
            views = [replace(v, tiers=v.tiers & wanted) for v in views if v.tiers & wanted]
        totals: dict[Tier, int] = {}
        for v in views:
            for t in tiers_of(v.tiers):
                if not wanted or t.bit & wanted:
                    totals[t] = totals.get(t, 0) + 1
        return Residency(views, totals, self.core.bus.last_sequence)

    def sessions(self, prefix: str, after: str | None, limit: int) -> SessionPage:
        core = self.core
        index = core.index
        # O(sessions * log(limit)): no sort of every session name per page.
        names = heapq.nsmallest(
            limit + 1, (s for s in index.sessions if s.startswith(prefix) and (after is None or s > after))
        )
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
                    retention=core.ledger.owner_view(session_owner(s), now),
                    continuations=tuple(sorted(state.continuations))[:MAX_MEMBERS_REPORTED],
                    last_active=state.last_active,
                )
            )
        next_after = page[-1] if len(names) > limit else None
        return SessionPage(views, next_after, core.bus.last_sequence)
