"""RetentionLedger: who retains or pins which block, until when.

Grants are held per (block hash, owner). The owner is the selector's owner key
(see model.Selector.owner). A block's effective class is the strongest
unexpired grant: PINNED > RETAINED (highest priority wins) > ORDINARY. A
grant whose deadline passed counts as absent even before the deadline queue
reclaims it, so a late expiry never extends protection.

A grant may carry an expected reuse time (`reuse_at`, monotonic seconds, at
most its deadline). A block's expectation is the earliest among its
unexpired grants that set one (a block shared by several sessions is due
when the first of them is); grants without one do not contribute. The
eviction order built on it lives with the engine (e.g.
engine_integration/protected.py): within a (class, priority), blocks with no
expectation or a passed one go first in LRU order, then the furthest
expected reuse first.

The pin budget counts distinct blocks with a pin grant; callers run
`expire(now)` first so that only unexpired pins count.

Cost: `view(h, now)` is what the pool asks on every admission, eviction and
refile of a block. A block with few grants is scanned (at most
_SCAN_OWNERS); a block with more (a shared system prompt retained by many
sessions) keeps two lazy heaps, strongest grant first and earliest
expectation first, so `view` is O(log grants) amortized whatever the number
of owners. Replaced and dropped grants leave the heaps lazily; the heaps are
rebuilt when stale entries outnumber live ones.

Not thread-safe: the engine thread owns it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .model import ORDINARY, RetentionClass, RetentionView
from .deadlines import DeadlineQueue

_RETAINED, _PINNED = RetentionClass.RETAINED, RetentionClass.PINNED
# A block with more grants than this gets heaps (see _Heaps); fewer are scanned.
_SCAN_OWNERS = 8


@dataclass(frozen=True, slots=True)
class Grant:
    pinned: bool
    priority: int
    deadline: float  # monotonic seconds
    expires_at: float  # wall-clock seconds (for reporting)
    reuse_at: float | None = None  # monotonic seconds; None: no expectation
    call: int = 0  # the grant() call that made it (its blocks share one deadline entry)


class _Call:
    """The blocks one grant() call granted (they share its deadline entry), and how many of
    them still hold its grant."""

    __slots__ = ("owner", "blocks", "live")

    def __init__(self, owner: str, blocks: list[bytes]) -> None:
        self.owner = owner
        self.blocks = blocks
        self.live = len(blocks)


class _Heaps:
    """The grants of one widely shared block, strongest first and earliest
    expectation first. Entries hold the Grant object; an entry is live while
    the owner's current grant on the block is that same object."""

    __slots__ = ("strong", "reuse", "seq")

    def __init__(self, per_block: dict[str, Grant]) -> None:
        self.seq = 0
        self.strong: list[tuple[int, int, float, int, str, Grant]] = []
        self.reuse: list[tuple[float, int, str, Grant]] = []
        for owner, g in per_block.items():
            self._push(owner, g)
        heapq.heapify(self.strong)
        heapq.heapify(self.reuse)

    def _push(self, owner: str, g: Grant, heap: bool = False) -> None:
        self.seq += 1
        # Max-heap on (pinned, priority (0 when pinned), expires_at) via negation.
        entry = (-int(g.pinned), 0 if g.pinned else -g.priority, -g.expires_at, self.seq, owner, g)
        if heap:
            heapq.heappush(self.strong, entry)
        else:
            self.strong.append(entry)
        if g.reuse_at is not None:
            r = (g.reuse_at, self.seq, owner, g)
            if heap:
                heapq.heappush(self.reuse, r)
            else:
                self.reuse.append(r)

    def add(self, owner: str, g: Grant) -> None:
        self._push(owner, g, heap=True)

    def stale(self, live: int) -> bool:
        return len(self.strong) > 2 * live + 16 or len(self.reuse) > 2 * live + 16

    def view(self, per_block: dict[str, Grant], now: float) -> RetentionView:
        best = _first_live(self.strong, per_block, now)
        if best is None:
            return ORDINARY
        g = best[-1]
        r = _first_live(self.reuse, per_block, now)
        reuse_at = None if r is None else r[0]
        if g.pinned:
            return RetentionView(_PINNED, 0, g.expires_at, reuse_at)
        return RetentionView(_RETAINED, g.priority, g.expires_at, reuse_at)


def _first_live(heap: list, per_block: dict[str, Grant], now: float) -> tuple | None:
    """The first heap entry (..., owner, grant) whose grant is current and unexpired at `now`.
    Entries of replaced or dropped grants are popped for good; entries whose
    grant is current but expired at `now` are set aside and pushed back (a
    later call may ask about an earlier `now`; expiry drops them)."""
    aside = []
    found = None
    while heap:
        top = heap[0]
        g = top[-1]
        if per_block.get(top[-2]) is not g:
            heapq.heappop(heap)
        elif g.deadline <= now:
            aside.append(heapq.heappop(heap))
        else:
            found = top
            break
    for entry in aside:
        heapq.heappush(heap, entry)
    return found


def _strongest(grants: Iterable[Grant], now: float) -> RetentionView:
    """The strongest unexpired grant among `grants` (and their earliest expected reuse)."""
    best: RetentionView = ORDINARY
    reuse_at: float | None = None
    for g in grants:
        if g.deadline <= now:
            continue
        if g.reuse_at is not None and (reuse_at is None or g.reuse_at < reuse_at):
            reuse_at = g.reuse_at
        if g.pinned:
            if best.cls is not RetentionClass.PINNED or (best.expires_at or 0) < g.expires_at:
                best = RetentionView(RetentionClass.PINNED, 0, g.expires_at)
        elif best.cls is RetentionClass.ORDINARY or (
            best.cls is RetentionClass.RETAINED
            and (g.priority, g.expires_at) > (best.priority, best.expires_at or 0.0)
        ):
            best = RetentionView(RetentionClass.RETAINED, g.priority, g.expires_at)
    if reuse_at is not None and best.cls is not RetentionClass.ORDINARY:
        best = RetentionView(best.cls, best.priority, best.expires_at, reuse_at)
    return best


class RetentionLedger:
    def __init__(self, pin_budget_blocks: int) -> None:
        self.pin_budget_blocks = pin_budget_blocks
        # block -> owner -> grant. Read-only outside this class; its truthiness
        # is the cheap "any retention in effect?" check on hot paths.
        self.grants: dict[bytes, dict[str, Grant]] = {}
        self._by_owner: dict[str, set[bytes]] = {}
        self._pin_holders: dict[bytes, int] = {}  # block -> number of unexpired pin grants
        # One deadline entry per grant() call, not per block. A call leaves the queue when its
        # last block's grant is replaced or dropped, or when its deadline passes.
        self._deadlines: DeadlineQueue[int] = DeadlineQueue()
        self._calls: dict[int, _Call] = {}
        self._call_ids = itertools.count(1)
        self._heaps: dict[bytes, _Heaps] = {}  # blocks with more than scan_owners grants
        self.scan_owners = _SCAN_OWNERS

    @property
    def pinned_blocks(self) -> int:
        return len(self._pin_holders)

    def pin_headroom(self) -> int:
        return max(0, self.pin_budget_blocks - len(self._pin_holders))

    def is_pinned(self, h: bytes) -> bool:
        return h in self._pin_holders

    def grant(
        self,
        owner: str,
        hashes: Iterable[bytes],
        *,
        pinned: bool,
        priority: int,
        deadline: float,
        expires_at: float,
        reuse_at: float | None = None,
    ) -> list[bytes]:
        """Grant (or replace) `owner`'s protection on each block. Returns the blocks.

        `reuse_at` (monotonic) is the expected next use, clamped to `deadline`."""
        granted = []
        if reuse_at is not None:
            reuse_at = min(reuse_at, deadline)
        call = next(self._call_ids)
        new = Grant(pinned, priority, deadline, expires_at, reuse_at, call)
        owned = self._by_owner.get(owner)  # created with the first block granted (none: no entry)
        heaps_of = self._heaps
        blocks: dict[bytes, None] = {}
        for h in hashes:
            per_block = self.grants.setdefault(h, {})
            old = per_block.get(owner)
            if old is not None and old is not new:
                if old.pinned:
                    self._unpin(h)
                self._release_call(old.call)
            per_block[owner] = new
            heaps = heaps_of.get(h)
            if heaps is not None:
                if heaps.stale(len(per_block)):
                    heaps_of[h] = _Heaps(per_block)
                else:
                    heaps.add(owner, new)
            elif len(per_block) > self.scan_owners:
                heaps_of[h] = _Heaps(per_block)
            if pinned and old is not new:
                self._pin_holders[h] = self._pin_holders.get(h, 0) + 1
            if owned is None:
                owned = self._by_owner[owner] = set()
            owned.add(h)
            blocks[h] = None
            granted.append(h)
        if blocks:
            self._calls[call] = _Call(owner, list(blocks))
            self._deadlines.schedule(call, deadline)
        return granted

    def _release_call(self, call: int) -> None:
        """One block of `call` no longer holds its grant; the call leaves the deadline queue
        with its last one."""
        entry = self._calls.get(call)
        if entry is None:
            return
        entry.live -= 1
        if entry.live <= 0:
            del self._calls[call]
            self._deadlines.cancel(call)

    def release(self, owner: str, hashes: Iterable[bytes] | None = None) -> list[bytes]:
        """Drop `owner`'s grants (on `hashes`, or all). Returns the blocks affected."""
        owned = self._by_owner.get(owner)
        if not owned:
            return []
        targets = list(owned) if hashes is None else [h for h in hashes if h in owned]
        for h in targets:
            self._drop(h, owner)
        return targets

    def drop_block(self, h: bytes) -> tuple[str, ...]:
        """Forget every grant on `h` (the block is gone). Returns the owners."""
        per_block = self.grants.get(h)
        if not per_block:
            return ()
        owners = tuple(per_block)
        for owner in owners:
            self._drop(h, owner)
        return owners

    def drop_pins(self, h: bytes) -> tuple[str, ...]:
        """Forget the pin grants on `h` (its device copy is gone; its retained grants stay).
        Returns the owners whose pins ended."""
        per_block = self.grants.get(h)
        if not per_block or h not in self._pin_holders:
            return ()
        owners = tuple(o for o, g in per_block.items() if g.pinned)
        for owner in owners:
            self._drop(h, owner)
        return owners

    def owners(self, h: bytes) -> tuple[str, ...]:
        per_block = self.grants.get(h)
        return tuple(per_block) if per_block else ()

    def pinned_by_other(self, h: bytes, owner: str, now: float) -> bool:
        per_block = self.grants.get(h)
        if not per_block:
            return False
        return any(o != owner and g.pinned and g.deadline > now for o, g in per_block.items())

    def owned_by(self, owner: str) -> set[bytes]:
        return set(self._by_owner.get(owner, ()))

    def owner_view(self, owner: str, now: float) -> RetentionView:
        """The strongest unexpired grant `owner` holds on any block; among equally strong ones,
        the one that ends last (when that protection ends, as `view` reports for a block)."""
        best: RetentionView = ORDINARY
        for h in self._by_owner.get(owner, ()):
            g = self.grants[h][owner]
            if g.deadline <= now:
                continue
            candidate = RetentionView(
                RetentionClass.PINNED if g.pinned else RetentionClass.RETAINED, 0 if g.pinned else g.priority, g.expires_at
            )
            if candidate.cls > best.cls or (
                candidate.cls == best.cls and (candidate.priority, g.expires_at) > (best.priority, best.expires_at or 0.0)
            ):
                best = candidate
        return best

    def view(self, h: bytes, now: float) -> RetentionView:
        """The effective class of `h` at monotonic time `now`."""
        per_block = self.grants.get(h)
        if not per_block:
            return ORDINARY
        heaps = self._heaps.get(h)
        if heaps is not None:
            return heaps.view(per_block, now)
        return _strongest(per_block.values(), now)

    def view_of(self, h: bytes, now: float, owned: Callable[[str], bool]) -> RetentionView:
        """The class `h` has from the grants of the owners `owned` accepts alone (a tenant's
        view of a shared block: other tenants' grants are not shown). O(grants on h)."""
        per_block = self.grants.get(h)
        if not per_block:
            return ORDINARY
        return _strongest((g for o, g in per_block.items() if owned(o)), now)

    def expire(self, now: float) -> list[bytes]:
        """Drop grants whose deadline passed. Returns the blocks affected."""
        if self._deadlines.earliest > now:  # nothing due (the engine asks before every reclaim)
            return []
        affected = []
        for call in self._deadlines.advance(now):
            entry = self._calls.pop(call, None)
            if entry is None:
                continue
            owner = entry.owner
            for h in entry.blocks:
                per_block = self.grants.get(h)
                grant = per_block.get(owner) if per_block else None
                if grant is not None and grant.call == call and grant.deadline <= now:
                    self._drop(h, owner, cancel=False)
                    affected.append(h)
        return affected

    def _drop(self, h: bytes, owner: str, cancel: bool = True) -> None:
        per_block = self.grants.get(h)
        if not per_block:
            return
        grant = per_block.pop(owner, None)
        if grant is None:
            return
        if grant.pinned:
            self._unpin(h)
        if not per_block:
            del self.grants[h]
            self._heaps.pop(h, None)
        elif h in self._heaps and len(per_block) <= self.scan_owners // 2:
            del self._heaps[h]  # few owners left: scanning is cheaper
        owned = self._by_owner.get(owner)
        if owned is not None:
            owned.discard(h)
            if not owned:
                del self._by_owner[owner]
        if cancel:
            self._release_call(grant.call)

    def _unpin(self, h: bytes) -> None:
        n = self._pin_holders.get(h, 0) - 1
        if n <= 0:
            self._pin_holders.pop(h, None)
        else:
            self._pin_holders[h] = n
