"""SessionPrefixIndex: session and continuation coordinates over block hashes.

Logical topology kept synchronously with cache activity (docs/design.md §3):
  * node[h]: parent link, chain position, resident tiers (bitmask), member
    sessions, child count, and the admitting session/continuation.
  * blocks_of[session] / node.members: many-to-many membership.
  * frontiers(session): the last resident block of each branch, computed on
    demand from membership and residency (so it is never stale: an evicted
    tail "retreats" to the nearest resident ancestor by construction).
  * continuations[c]: the block a continuation position lies in.

Only blocks touched by requests with session coordinates get nodes: anonymous
traffic costs one dict lookup per removal. A node whose last copy is removed
stays while it connects resident descendants (a parent-only node); otherwise
it is deleted, cascading up. A resident node stays while a session or a
continuation holds it.

Membership semantics (what WatchEvents followers reproduce, see
kvhint_client/residency_index.py and the proto's MembershipChanged):
  * a session joins a block only through `record_chain` with its session id
    (a store or a prefix hit by one of its requests);
  * it leaves the block when the block's last copy is removed (a parent-only
    node has no members), or when the whole session is forgotten
    (`forget_session`: Release, the index size cap); the `listener` hears the
    latter, with the blocks the session left;
  * a session expires with its last member block, so every live session has
    at least one resident block and `blocks` holds resident blocks only.

Cost: joining or leaving a block is O(1) per session (a set insert/discard);
`members(h)` reports at most MAX_MEMBERS_REPORTED of them in O(that cap),
never a sort of the member set. Memory is O(nodes + live sessions +
membership edges); a session's edges are bounded by its resident blocks.

Not thread-safe: the engine thread owns it.
"""

from __future__ import annotations

import itertools

import enum
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import NamedTuple

from .model import RequestCoords, Tier, tiers_of

# The one cap on sessions *reported* per block: SessionCoordinates.member_session_ids
# in events, BlockInfo.session_ids in queries and snapshots, and the member list
# of a removal. The index itself tracks every member (a session's own queries
# must see its shared prefix); reporting more than this per block would make
# every event on a widely shared block O(members).
MAX_MEMBERS_REPORTED = 16


class LeaveCause(enum.IntEnum):
    """Why a session left blocks that stay resident (wire: MembershipChanged.Cause)."""

    RELEASED = 1  # a Release hint on the whole session
    INDEX_LIMIT = 2  # the index was over max_index_blocks / max_index_sessions; least recently active sessions go first


# listener(session, blocks it left in chain order, cause)
LeaveListener = Callable[[str, tuple[bytes, ...], LeaveCause], None]


# A node's members: None (no member), the one member's id, or a set of two or more (a set
# may shrink back to one or none). Most blocks belong to one session, and a str, unlike a
# set, is not an object Python's cyclic garbage collector traverses at every full
# collection: the index is built while the engine serves, after vLLM froze its start-up heap.
Members = str | set[str] | None


@dataclass(slots=True)
class Node:
    parent: bytes | None
    position: int
    tiers: int = 0
    children: int = 0
    members: Members = None
    admit_session: str | None = None
    admit_continuation: str | None = None

    @property
    def sessions(self) -> frozenset[str]:
        """The member sessions (a copy: for readers outside the hot paths)."""
        return frozenset(_iter(self.members))

    def has_member(self, session: str) -> bool:
        m = self.members
        return m == session if m.__class__ is str else (m is not None and session in m)


def _iter(m: Members) -> Iterable[str]:
    if m is None:
        return ()
    return (m,) if m.__class__ is str else m  # type: ignore[return-value]


def _held_by_member(m: Members) -> bool:
    return m is not None and (m.__class__ is str or bool(m))


class Removal(NamedTuple):
    """What a removal meant in session coordinates. `sessions`: members before
    the removal, at most MAX_MEMBERS_REPORTED of them."""

    block_hash: bytes
    position: int
    last_copy: bool
    admit_session: str | None
    admit_continuation: str | None
    sessions: tuple[str, ...]


@dataclass(slots=True)
class SessionState:
    parent: str | None = None
    # Member blocks; all resident (a block's last copy takes its members with it).
    blocks: set[bytes] = field(default_factory=set)
    continuations: set[str] = field(default_factory=set)
    last_active: float = 0.0

    @property
    def resident(self) -> int:
        return len(self.blocks)


def _reported(members: Members, first: str | None, limit: int) -> tuple[str, ...]:
    """At most `limit` of `members` in O(limit); `first` leads when it is one of them."""
    if members is None:
        return ()
    if members.__class__ is str:
        return (members,)  # type: ignore[return-value]
    if len(members) <= 1 or first is None or first not in members:
        return tuple(islice(members, limit))
    return (first, *islice((s for s in members if s != first), limit - 1))


class SessionPrefixIndex:
    def __init__(self) -> None:
        self.nodes: dict[bytes, Node] = {}
        self.sessions: dict[str, SessionState] = {}
        self.children_of: dict[str, set[str]] = {}
        self.continuations: dict[str, bytes] = {}
        # When each continuation was first recorded (the order of `continuations`): the block
        # bound weighs a continuation against the sessions' last activity (forget_least_active).
        self._continuation_since: dict[str, float] = {}
        self._continuations_at: dict[bytes, set[str]] = {}
        # continuation -> the live sessions listing it (SessionState.continuations): one session
        # (a str, the usual case) or a set of them. Forgetting a session asks "does another
        # session hold it?" in O(1), and a continuation the index stops tracking (its chain gone,
        # or the bounds forgot it) leaves its sessions' lists, so a long-lived session lists the
        # continuations a selector can still resolve rather than every one it ever had.
        self._continuation_sessions: dict[str, Members] = {}
        # Children recorded before their parent: parent hash -> how many tracked nodes name it
        # as parent while it is not tracked itself. A parent recorded later starts with that
        # count (a run may be recorded before the block before it: a sliding-window tail, a
        # caller's explicit parent), so `children` always counts the tracked nodes naming it.
        self._orphans: dict[bytes, int] = {}
        # Hears every forget_session that took a session off blocks.
        self.listener: LeaveListener | None = None

    # ------------------------------------------------------------------ updates

    def record_chain(
        self,
        hashes: Sequence[bytes],
        first_position: int,
        parent: bytes | None,
        tier: Tier,
        coords: RequestCoords,
        now: float,
        other_tiers: Callable[[bytes], int] | None = None,
    ) -> None:
        """`hashes` (chain order, the first at `first_position`, after `parent`)
        are resident on `tier` and belong to the request's session.

        Used both for stores and for prefix hits (a hit establishes membership
        though it stores nothing). A no-op for requests without coordinates.
        `other_tiers(h)` gives the tier bitmask of copies a block already had
        before the index tracked it (anonymous lower-tier copies), so a new
        node starts with every tier it is resident on.
        """
        if not coords or not hashes:
            return
        session = coords.session_id
        state = self._session(session, coords.parent_session_id, now) if session else None
        prev = parent
        bit = 1 << tier
        nodes = self.nodes
        continuation = coords.continuation_id
        for offset, h in enumerate(hashes):
            node = nodes.get(h)
            if node is None:
                existing = other_tiers(h) if other_tiers is not None else 0
                orphans = self._orphans
                children = orphans.pop(h, 0) if orphans else 0
                node = Node(prev, first_position + offset, existing | bit, children, None, session, continuation)
                nodes[h] = node
                if prev is not None:
                    if (parent_node := nodes.get(prev)) is not None:
                        parent_node.children += 1
                    else:
                        orphans[prev] = orphans.get(prev, 0) + 1
            else:
                node.tiers |= bit
            if state is not None:
                m = node.members
                if m is None:
                    node.members = session
                    state.blocks.add(h)
                elif m.__class__ is str:
                    if m != session:
                        node.members = {m, session}  # type: ignore[set-item]
                        state.blocks.add(h)
                elif session not in m:  # type: ignore[operator]
                    m.add(session)  # type: ignore[union-attr, arg-type]
                    state.blocks.add(h)
            prev = h
        last = hashes[-1]
        if state is not None and coords.continuation_id and coords.continuation_id not in state.continuations:
            state.continuations.add(coords.continuation_id)
            listing = self._continuation_sessions
            held = listing.get(coords.continuation_id)
            if held is None:
                listing[coords.continuation_id] = session
            elif held.__class__ is str:
                listing[coords.continuation_id] = {held, session}  # type: ignore[assignment]
            else:
                held.add(session)  # type: ignore[union-attr]
        if coords.continuation_id:
            if coords.continuation_id not in self.continuations:
                self._continuation_since[coords.continuation_id] = now
            self._point_continuation(coords.continuation_id, last)

    def mark_resident(self, h: bytes, tier: Tier) -> bool:
        """A copy of a known block appeared on `tier` (a connector store, or a
        request without a session re-storing it). Returns False for blocks the
        index does not track."""
        node = self.nodes.get(h)
        if node is None:
            return False
        node.tiers |= 1 << tier  # membership is unchanged: a parent-only node has none
        return True

    def mark_removed(self, h: bytes, tier: Tier) -> Removal | None:
        """The copy of `h` on `tier` is gone. None for untracked blocks. The
        last copy takes the block's members with it (O(1) per member); a
        session left with no block expires."""
        node = self.nodes.get(h)
        if node is None:
            return None
        bit = 1 << tier
        tiers = node.tiers
        had_copy = tiers & bit
        node.tiers = tiers = tiers & ~bit
        members = node.members
        admit = node.admit_session
        removal = Removal(
            h,
            node.position,
            tiers == 0,
            admit,
            node.admit_continuation,
            # = self.members(h, first=admit), with the common one-member case inlined
            (members,) if members.__class__ is str else _reported(members, admit, MAX_MEMBERS_REPORTED),  # type: ignore[arg-type]
        )
        if tiers or not had_copy:
            return removal  # another copy remains, or there was none to lose
        expired = []
        if members is not None:
            node.members = None  # the last copy takes the members with it
            sessions = self.sessions
            for member in _iter(members):
                blocks = sessions[member].blocks
                blocks.discard(h)
                if not blocks:
                    expired.append(member)
        if node.children == 0:
            self._delete_upwards(h)
        for member in expired:
            self.forget_session(member)
        return removal

    def clear_tier(self, tier: Tier) -> set[str]:
        """Every copy on `tier` is gone (e.g. a prefix-cache reset). Returns
        the sessions that held any of those blocks."""
        bit = 1 << tier
        affected: set[str] = set()
        for h in [h for h, n in self.nodes.items() if n.tiers & bit]:
            node = self.nodes.get(h)
            if node is not None:
                affected.update(_iter(node.members))
                self.mark_removed(h, tier)
        return affected

    def forget_session(self, session: str, cause: LeaveCause = LeaveCause.RELEASED) -> bool:
        """Drop a session's membership, frontiers and continuations. Blocks stay
        cached (anonymously) unless another session holds them. The listener
        hears which blocks the session left (when it held any)."""
        state = self.sessions.pop(session, None)
        if state is None:
            return False
        if state.blocks and self.listener is not None:
            self.listener(session, tuple(self._chain_order(state.blocks)), cause)
        for h in state.blocks:
            node = self.nodes.get(h)
            if node is None:
                continue
            m = node.members
            if m == session:
                node.members = None
            elif m is not None and m.__class__ is not str:
                m.discard(session)  # type: ignore[union-attr]
        listing = self._continuation_sessions
        for c in list(state.continuations):  # (unpointing one may drop others from the set)
            held = listing.get(c)
            if held is not None and held.__class__ is not str:
                held.discard(session)  # type: ignore[union-attr]
                if held:
                    if len(held) == 1:  # type: ignore[arg-type]
                        listing[c] = next(iter(held))  # type: ignore[call-overload]
                    continue  # another live session holds it
            listing.pop(c, None)
            if c in self.continuations:
                self._unpoint_continuation(c)
        for h in state.blocks:
            node = self.nodes.get(h)
            if node is not None and not _held_by_member(node.members) and node.children == 0:
                self._delete_upwards(h)
        if state.parent is not None:
            siblings = self.children_of.get(state.parent)
            if siblings is not None:
                siblings.discard(session)
                if not siblings:
                    del self.children_of[state.parent]
        return True

    # ------------------------------------------------------------------ queries

    def node(self, h: bytes) -> Node | None:
        return self.nodes.get(h)

    def session_tree(self, session: str, include_children: bool) -> list[str]:
        """The session and (optionally) its descendants that the index knows."""
        out = [session] if session in self.sessions else []
        if include_children:
            stack = list(self.children_of.get(session, ()))
            seen = {session}
            while stack:
                child = stack.pop()
                if child in seen:
                    continue
                seen.add(child)
                if child in self.sessions:
                    out.append(child)
                stack.extend(self.children_of.get(child, ()))
        return out

    def continuations_leaving_with(self, sessions: Iterable[str]) -> list[str]:
        """The continuations that forgetting every one of `sessions` would stop tracking: those
        they list that no other live session lists (forget_session), in the order listed."""
        leaving = dict.fromkeys(sessions)
        listing = self._continuation_sessions
        out: dict[str, None] = {}
        for s in leaving:
            state = self.sessions.get(s)
            if state is None:
                continue
            for c in state.continuations:
                if all(holder in leaving for holder in _iter(listing.get(c))):
                    out[c] = None
        return list(out)

    def sessions_listing(self, continuation: str) -> list[str]:
        """The live sessions whose lists hold `continuation` (empty when the index does not track it)."""
        return list(_iter(self._continuation_sessions.get(continuation)))

    def resolve_session(self, session: str, include_children: bool = False) -> list[bytes]:
        """Every block of the session (and children), in chain order."""
        blocks: set[bytes] = set()
        for s in self.session_tree(session, include_children):
            blocks |= self.sessions[s].blocks
        return self._chain_order(blocks)

    def resolve_continuation(self, continuation: str) -> list[bytes]:
        """The prefix chain ending at the continuation's block, root first."""
        h = self.continuations.get(continuation)
        chain: list[bytes] = []
        while h is not None:
            node = self.nodes.get(h)
            if node is None:
                break
            chain.append(h)
            h = node.parent
        chain.reverse()
        return chain

    def frontiers(self, session: str) -> set[bytes]:
        """The last resident block of each of the session's branches: its
        resident blocks that are no ancestor of another of its resident blocks."""
        state = self.sessions.get(session)
        if state is None:
            return set()
        nodes = self.nodes
        resident = {h for h in state.blocks if nodes[h].tiers}
        ancestors: set[bytes] = set()
        for h in resident:
            p = nodes[h].parent
            while p is not None and p not in ancestors:
                ancestors.add(p)
                parent_node = nodes.get(p)
                p = parent_node.parent if parent_node is not None else None
        return resident - ancestors

    def iter_sessions(self) -> Iterator[tuple[str, SessionState]]:
        return iter(self.sessions.items())

    def tier_counts(self, hashes: Iterable[bytes]) -> dict[Tier, int]:
        counts: dict[Tier, int] = {}
        for h in hashes:
            node = self.nodes.get(h)
            if node is None:
                continue
            for t in tiers_of(node.tiers):
                counts[t] = counts.get(t, 0) + 1
        return counts

    def resident_sessions_of(self, h: bytes) -> tuple[str, ...]:
        """Every member of `h` (O(members): for hints, not for per-event paths)."""
        node = self.nodes.get(h)
        return tuple(_iter(node.members)) if node is not None else ()

    def members(self, h: bytes, limit: int | None = None, first: str | None = None) -> tuple[str, ...]:
        """At most `limit` (default MAX_MEMBERS_REPORTED, read at the call) members of `h`, in
        O(limit), whatever the member count; `first` leads the list when it is a member."""
        node = self.nodes.get(h)
        if node is None:
            return ()
        return _reported(node.members, first, MAX_MEMBERS_REPORTED if limit is None else limit)

    # ------------------------------------------------------------------ internals

    def _session(self, session: str, parent: str | None, now: float) -> SessionState:
        state = self.sessions.get(session)
        if state is None:
            state = SessionState(parent=parent if parent and parent != session else None)
            self.sessions[session] = state
            if state.parent is not None:
                self.children_of.setdefault(state.parent, set()).add(session)
        elif parent and state.parent is None and parent != session:
            state.parent = parent
            self.children_of.setdefault(parent, set()).add(session)
        state.last_active = now
        return state

    def _chain_order(self, blocks: Iterable[bytes]) -> list[bytes]:
        nodes = self.nodes
        keyed = [((n.position, h) if (n := nodes.get(h)) is not None else (1 << 62, h)) for h in blocks]
        keyed.sort()
        return [h for _, h in keyed]

    def _delete_upwards(self, h: bytes | None) -> None:
        """Delete `h` unless it has children or is held, then its parent likewise."""
        nodes, continuations_at = self.nodes, self._continuations_at
        while h is not None:
            node = nodes.get(h)
            # A resident node stays while a session or a continuation holds it.
            if node is None or node.children > 0 or (node.tiers and (_held_by_member(node.members) or h in continuations_at)):
                return
            del nodes[h]
            for member in _iter(node.members):  # none: an unheld node has no members
                state = self.sessions.get(member)
                if state is not None:
                    state.blocks.discard(h)
            parent = node.parent
            for c in self._continuations_at.pop(h, ()):
                if parent is not None and parent in self.nodes:
                    self._point_continuation(c, parent)
                else:
                    self.continuations.pop(c, None)
                    self._continuation_since.pop(c, None)
                    self._unlist_continuation(c)
            if parent is not None:
                if (parent_node := self.nodes.get(parent)) is not None:
                    parent_node.children -= 1
                else:  # recorded before its parent, which is still untracked
                    orphans = self._orphans
                    left = orphans.get(parent, 0) - 1
                    if left > 0:
                        orphans[parent] = left
                    else:
                        orphans.pop(parent, None)
            h = parent

    def _point_continuation(self, c: str, h: bytes) -> None:
        old = self.continuations.get(c)
        if old == h:
            return
        self.continuations[c] = h
        self._continuations_at.setdefault(h, set()).add(c)
        if old is not None:
            holders = self._continuations_at.get(old)
            if holders is not None:
                holders.discard(c)
                if not holders:
                    del self._continuations_at[old]
                    self._delete_upwards(old)

    def forget_least_active(self, block_target: int, session_target: int, cause: LeaveCause) -> tuple[int, int]:
        """The index's block and session bounds: until at most `block_target` blocks and
        `session_target` sessions are tracked, forget the least recently active session, or,
        while the blocks are over their target, the continuation recorded longest ago when it
        is older. A continuation holds its block and the chain before it whether or not a
        session does, so forgetting sessions alone cannot bring the blocks down where
        continuations hold them. Returns how many sessions and continuations were forgotten.
        O((sessions + continuations) log) per call: only when a bound is passed."""
        by_age = sorted([(state.last_active, 0, s) for s, state in self.sessions.items()]
                        + [(since, 1, c) for c, since in self._continuation_since.items()])
        sessions = continuations = 0
        for _, kind, key in by_age:
            over_blocks = len(self.nodes) > block_target
            if not over_blocks and len(self.sessions) <= session_target:
                break
            if kind == 0:
                sessions += self.forget_session(key, cause)
            elif over_blocks and key in self.continuations:  # (a forgotten session may have taken it)
                self._unpoint_continuation(key)
                continuations += 1
        return sessions, continuations

    def forget_oldest_continuations(self, n: int) -> int:
        """Forget the `n` continuations recorded first (the index's bound; their blocks stay
        cached and their sessions' memberships stay; the sessions stop listing them). Returns how many were forgotten."""
        oldest = list(itertools.islice(self.continuations, max(0, n)))
        for c in oldest:
            self._unpoint_continuation(c)
        return len(oldest)

    def _unpoint_continuation(self, c: str) -> None:
        """Forget a continuation; the block it held may go with it."""
        h = self.continuations.pop(c, None)
        self._continuation_since.pop(c, None)
        if h is None:
            return
        self._unlist_continuation(c)
        holders = self._continuations_at.get(h)
        if holders is not None:
            holders.discard(c)
            if not holders:
                del self._continuations_at[h]
                self._delete_upwards(h)

    def _unlist_continuation(self, c: str) -> None:
        """The index no longer tracks continuation `c`: it leaves the lists of the sessions that
        had it (SessionState.continuations, GetSession's continuation_ids)."""
        held = self._continuation_sessions.pop(c, None)
        sessions = self.sessions
        for s in _iter(held):
            state = sessions.get(s)
            if state is not None:
                state.continuations.discard(c)
