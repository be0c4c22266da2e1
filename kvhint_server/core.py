"""KvHintCore: the engine-side state behind the sidecar.

Owns the SessionPrefixIndex, the RetentionLedger, the EventBus, the operation
registry and the queue of engine-thread tasks. Adapters report residency
changes through the `on_*` hooks (engine thread) and drive `run_pending()` at
step boundaries; the gRPC side submits work with `submit()` (any thread), and
long read-side work (snapshots) in bounded slices with `submit_slice()`.

Overload (kvhint_server/overload.py): a `bounded=True` submit (every RPC's)
fails with QueueFull, queuing nothing, while `config.max_pending_tasks` tasks
are pending. `run_pending()` runs queued tasks for at most
`config.step_apply_budget_ms` per step (at least one task; a task is never
split), the rest waits for the next step and the adapter is asked for another
wakeup; each task's future reports in `deferred_steps` how many step budgets
ran out while it waited.

Events and queries agree: every change to what QueryResidency/ListSessions
report (residency per tier, session membership) is published, in the order
it happened, as BlocksStored / BlocksRemoved / AllBlocksCleared /
MembershipChanged (the index's leave listener). `resident[tier]` mirrors the
published residency of every block, tracked or not, so snapshots can list it
without a walk over the engine's cache.

Tenancy: every event is tagged, as it is published, with the tenants whose
subscriptions get it (tenant_guard.TenantRouter). The core adds what an event's
sessions cannot tell: a removal reaches every tenant with a member of the block
(an event names at most 16) or shown the block resident without holding it now
(`_shown_tenants`), and a PinBroken each tenant whose grant broke, with its own
blocks (`drop_grants` returns the owners: EndedGrants).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from functools import partial
from typing import TypeVar

from .adapter import EngineAdapter
from .config import ServerConfig
from .events import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    NO_COORDINATES,
    Coordinates,
    EventBus,
    MembershipChanged,
    PinBroken,
    TierTransferCompleted,
)
from .executor import HintExecutor
from .index import MAX_MEMBERS_REPORTED, LeaveCause, Node, Removal, SessionPrefixIndex
from .journal import ResidencyJournal
from .model import EngineInfo, RemovalCause, RequestCoords, RetentionView, Tier, session_of_owner
from .operations import OperationRegistry
from .overload import OverloadStats, QueueFull, queue_retry_after
from .queries import Queries
from .retention import RetentionLedger
from .tenant_guard import TenantRouter

log = logging.getLogger("kvhint.core")
T = TypeVar("T")
# Engine time per step for `submit_slice` work (all slices together, at least
# one slice per step).
SLICE_BUDGET_S = 0.004
# Device removals after which a lower tier that honours retention keeps a block's retained grants
# (KvHintCore.end_device_grants): evictions, and Demote's reclaim of the device copies.
_HELD_BELOW = frozenset((RemovalCause.EVICTED, RemovalCause.DEMOTED))


class EngineStopped(RuntimeError):
    """The engine stopped before running the task."""


class TaskFuture(Future[T]):
    """The future of an engine-thread task."""

    #: Steps that ended with their budget spent while this task waited.
    deferred_steps: int = 0


def _run(future: Future[T], fn: Callable[[], T]) -> None:
    """Run one engine-thread task into its future (skipped if cancelled)."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn())
    except BaseException as exc:  # noqa: BLE001 - delivered to the caller
        log.exception("kvhint engine task failed")
        future.set_exception(exc)


class KvHintCore:
    def __init__(
        self,
        config: ServerConfig,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.monotonic = monotonic
        self.wall = wall
        self.index = SessionPrefixIndex()
        self.index.listener = self._on_leave
        # tier -> blocks resident on it, as published (tracked or not). Dicts used
        # as ordered sets: a snapshot copies them, and copying in insertion order
        # (≈ allocation order) is several times faster than a set's hash order.
        self.resident: dict[Tier, dict[bytes, None]] = {t: {} for t in Tier}
        self.bus = EventBus(config.event_replay_window, clock=wall)
        # With tenancy: tags every event with the tenants whose subscriptions may receive it,
        # once, where it is published (tenant_guard.TenantRouter).
        self.router = TenantRouter(config.tenants) if config.tenants is not None else None
        self.bus.route = self.router
        # With tenancy: block -> tenants whose subscriptions were shown it resident although
        # none of their sessions may be a member of it (now or any more): a BlocksStored that
        # named their session lists blocks their session is not a member of, or their session
        # left it (MembershipChanged) while it stayed resident. Their followers hold it until
        # its removal, which must reach them too (`_removal_tenants`). Kept with the index (its
        # bookkeeping paths); an entry goes with the block's last copy (bounded by the resident
        # blocks), and exists only where such a tenant is not a member.
        self._shown_tenants: dict[bytes, frozenset[str]] = {}
        self.operations = OperationRegistry(self.bus, config.operation_history)
        self.ledger = RetentionLedger(0)
        self._adapter: EngineAdapter | None = None
        self._info: EngineInfo | None = None
        # Tier bitmasks of the lower tiers that honour retention (attach: TierInfo.honours_retention),
        # and of every tier a grant protects copies on (the device, and those).
        self.lower_retention_tiers = 0
        self.retention_tiers = Tier.DEVICE.bit
        # (fn, future, budget cutoffs so far, perf_counter at submit)
        self._tasks: deque[tuple[Callable[[], object], TaskFuture[object], int, float]] = deque()
        self._slices: deque[tuple[Callable[[float], object], Future[object]]] = deque()
        self._tasks_lock = threading.Lock()
        self._stopped = False
        self.overload = OverloadStats()
        # The engine-thread state's users, owned here so that the gRPC servicer
        # and the engine's own paths (request envelopes) share one of each:
        # the executor's idempotency window is the engine's, whoever applied.
        self.executor = HintExecutor(self)
        self.queries = Queries(self)
        self._cutoffs = 0  # steps whose task budget ran out with tasks left
        self._recent_wait = 0.0  # EWMA of the queue wait of tasks run, seconds
        # Residency bookkeeping, inline or deferred (journal.py): adapters report
        # residency changes through `record`; `exclusive` sections see them all.
        self.journal = ResidencyJournal()
        # Engine thread: book a residency change, `record(fn, *args)` (one of the `on_*`
        # hooks below, or an adapter's step that reads the index first). Deferred to the
        # journal's settler when it runs and no exclusive section is open; otherwise run
        # now, after everything journaled before it. The entries never touch the retention
        # ledger (the engine thread's: a removal's grants end in `drop_grants`, before it
        # is recorded), so deferral goes on while grants are in effect. The journal's own
        # method, bound once: the hooks call it for every vLLM call that changes residency.
        self.record: Callable[..., None] = self.journal.record

    # ------------------------------------------------------------ wiring

    def attach(self, adapter: EngineAdapter) -> None:
        self._adapter = adapter
        self._info = adapter.info()
        self.lower_retention_tiers = 0
        for t in self._info.tiers:
            if t.honours_retention and t.tier is not Tier.DEVICE:
                self.lower_retention_tiers |= t.tier.bit
        self.retention_tiers = Tier.DEVICE.bit | self.lower_retention_tiers
        usable = max(0, self._info.num_device_blocks - 1)
        self.ledger.pin_budget_blocks = int(usable * self.config.pin_budget_fraction)

    @property
    def adapter(self) -> EngineAdapter:
        if self._adapter is None:
            raise RuntimeError("no engine adapter attached")
        return self._adapter

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise RuntimeError("no engine adapter attached")
        return self._info

    # ------------------------------------------------------------ engine-thread tasks

    def submit(self, fn: Callable[[], T], *, bounded: bool = False) -> TaskFuture[T]:
        """Run `fn` on the engine thread at the next step boundary (any thread).

        The future fails with EngineStopped if the engine stops first, and,
        when `bounded` (RPC work), with QueueFull if the queue is at
        `config.max_pending_tasks` (nothing queued). A caller that gives up
        may `cancel()` the future; a cancelled task is skipped if it has not
        started.
        """
        future: TaskFuture[T] = TaskFuture()
        with self._tasks_lock:
            if self._refused(future, bounded):
                return future
            self._tasks.append((fn, future, self._cutoffs, time.perf_counter()))  # type: ignore[arg-type]
        self.adapter.request_wakeup()
        return future

    def submit_slice(self, fn: Callable[[float], T], *, bounded: bool = False) -> TaskFuture[T]:
        """Run `fn(deadline)` on the engine thread at a step boundary, after
        the step's tasks, sharing SLICE_BUDGET_S per step with other slices
        (any thread). `fn` must return soon after `time.perf_counter()`
        passes `deadline`: it is one bounded piece of a longer job, whose
        caller submits the next piece once this one's future resolves.
        `bounded` as for `submit`.
        """
        future: TaskFuture[T] = TaskFuture()
        with self._tasks_lock:
            if self._refused(future, bounded):
                return future
            self._slices.append((fn, future))  # type: ignore[arg-type]
        self.adapter.request_wakeup()
        return future

    def _refused(self, future: Future[T], bounded: bool) -> bool:
        """Under _tasks_lock: fail `future` if the engine stopped, or if
        `bounded` and the queue is full."""
        if self._stopped:
            future.set_exception(EngineStopped("engine is shutting down"))
            return True
        pending = self.pending_tasks()
        if bounded and pending >= self.config.max_pending_tasks:
            self.overload.queue_full += 1
            future.set_exception(QueueFull(pending, self.config.max_pending_tasks, self.queue_retry_after()))
            return True
        return False

    def queue_retry_after(self) -> float:
        """The RetryInfo delay for a refused task: how long tasks recently waited, bounded."""
        return queue_retry_after(self._recent_wait)

    def pending_tasks(self) -> int:
        """Tasks and slices queued now (the queue-depth metric)."""
        return len(self._tasks) + len(self._slices)

    def has_pending(self) -> bool:
        return bool(self._tasks or self._slices)

    def expire_retention(self) -> None:
        """Engine thread: drop expired grants and re-file their blocks, the chains' tails
        first (the order `EngineAdapter.refile` takes)."""
        if self.ledger.grants:
            expired = self.ledger.expire(self.monotonic())
            if expired:
                self.adapter.refile(self.tail_first(expired))

    def tail_first(self, hashes: Iterable[bytes]) -> list[bytes]:
        """These blocks by chain position, the deepest first (several chains interleave by
        position, equal positions in the given order), then those the index does not know in
        the given order: the order `EngineAdapter.refile` wants (expiry gets a grant's blocks
        root first, a Release a set). Also called outside an exclusive section (expiry): a
        node's position never changes, and one dict lookup per block is safe while the settler
        changes the index (no Python code runs inside it)."""
        nodes = self.index.nodes

        def depth_first(h: bytes) -> int:  # positions are >= 0: unknown blocks (1) sort last
            node = nodes.get(h)
            return -node.position if node is not None else 1

        return sorted(hashes, key=depth_first)  # stable: ties keep the given order

    # ------------------------------------------------------------ residency bookkeeping

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Engine thread: a section that reads or changes the index, the ledger
        or the event order (hints, queries, snapshots). Everything journaled
        is settled first, the settler waits, and residency changes the section
        causes (an Evict's removals) are booked inline."""
        journal = self.journal
        with journal.lock:
            if journal.pending():
                journal.settle()
            journal.hold()
            try:
                yield
            finally:
                journal.release()

    def settle(self) -> None:
        """Apply every journaled residency change now (any thread); after it,
        the index and the event stream include every change reported so far."""
        self.journal.settle()

    def run_pending(self) -> None:
        """Engine thread, at a step boundary: expire retention, run queued
        tasks for at most config.step_apply_budget_ms (at least one), then
        slices for at most SLICE_BUDGET_S. Asks for another wakeup when work
        is left."""
        # The ledger and the pool's filing are the engine thread's alone (journal entries
        # touch neither), so expiry needs no exclusive section (which would settle the journal).
        try:
            self.expire_retention()
        except Exception:  # noqa: BLE001 - an adapter error must not end vLLM's step (EngineCore)
            log.exception("kvhint: retention expiry failed")
        if not (self._tasks or self._slices):
            return
        with self.exclusive():
            if self._tasks:
                self._run_tasks()
            if self._slices:
                deadline = time.perf_counter() + SLICE_BUDGET_S
                ran = False
                while self._slices and not (ran and time.perf_counter() >= deadline):
                    with self._tasks_lock:
                        if not self._slices:
                            break
                        fn, future = self._slices.popleft()
                    ran = True
                    _run(future, partial(fn, deadline))
        if self._tasks or self._slices:
            self.adapter.request_wakeup()

    def _run_tasks(self) -> None:
        budget = self.config.step_apply_budget_ms / 1000.0
        deadline = time.perf_counter() + budget if budget > 0 else float("inf")
        ran = False
        while self._tasks:
            now = time.perf_counter()
            if ran and now >= deadline:
                self._cutoffs += 1
                self.overload.budget_cutoffs += 1
                return
            with self._tasks_lock:
                if not self._tasks:
                    break
                fn, future, cutoffs, submitted = self._tasks.popleft()
            self._recent_wait = 0.8 * self._recent_wait + 0.2 * (now - submitted)
            future.deferred_steps = self._cutoffs - cutoffs
            ran = True
            _run(future, fn)

    def stop(self) -> None:
        """Fail queued tasks; later submits fail immediately. Settles the journal."""
        self.journal.stop()
        with self._tasks_lock:
            self._stopped = True
            futures = [t[1] for t in self._tasks] + [t[1] for t in self._slices]
            self._tasks, self._slices = deque(), deque()
        for future in futures:
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineStopped("engine is shutting down"))

    # ------------------------------------------------------------ residency hooks

    def retention(self, h: bytes) -> RetentionView:
        return self.ledger.view(h, self.monotonic())

    def drop_grants(self, hashes: Iterable[bytes]) -> EndedGrants:
        """Engine thread, where the blocks' last device copies left (before the removal is
        recorded): their retention grants end now, whether the removal's bookkeeping runs
        inline or deferred. Returns the sessions of the grants' owners, first seen first, with
        each block's owners (EndedGrants). Pass `grants_dropped=True` to the `on_removed` /
        `on_cleared` that books the same change; pass the result itself to `on_pin_broken`."""
        ledger = self.ledger
        ended = EndedGrants()
        grants = ledger.grants
        if not grants:
            return ended
        for h in filter(grants.__contains__, hashes):  # most removed blocks hold no grant
            ended.add(h, ledger.drop_block(h))
        return ended

    def end_device_grants(
        self, hashes: Sequence[bytes], cause: RemovalCause, lower_tiers: Callable[[bytes], int] | None
    ) -> EndedGrants:
        """Engine thread, where the blocks' last device copies left: `drop_grants`, except that
        a block evicted (to make room, or reclaimed after a Demote) while a lower tier that
        honours retention (TierInfo.honours_retention) holds a copy keeps its retained grants,
        which order that tier's eviction until they end or its copy goes too
        (`on_removed`). Its pins end: pins and the pin budget are about device copies.
        `lower_tiers(h)`: the tier bitmask of `h`'s lower-tier copies. Returns the sessions
        whose grants ended, as `drop_grants`."""
        lower = self.lower_retention_tiers
        if not lower or lower_tiers is None or cause not in _HELD_BELOW or not self.ledger.grants:
            return self.drop_grants(hashes)
        grants = self.ledger.grants
        held, gone = [], []
        for h in hashes:
            if h in grants:
                (held if lower_tiers(h) & lower else gone).append(h)
        ended = self.drop_grants(gone)
        for h in held:
            ended.add(h, self.ledger.drop_pins(h))
        return ended

    def clear_grants(self) -> None:
        """Engine thread: the device cache was cleared; every grant ends now (see
        `drop_grants`; book it with `on_cleared(Tier.DEVICE, grants_dropped=True)`), but the
        retained grants of blocks a lower tier that honours retention holds (`end_device_grants`)."""
        ledger = self.ledger
        lower = [t for t in self.resident if t.bit & self.lower_retention_tiers]
        if not lower or not ledger.grants:
            self.ledger = RetentionLedger(ledger.pin_budget_blocks)
            return
        for h in list(ledger.grants):
            if any(h in self.resident[t] for t in lower):
                ledger.drop_pins(h)
            else:
                ledger.drop_block(h)

    def on_stored(
        self,
        hashes: Sequence[bytes],
        *,
        first_position: int,
        parent: bytes | None,
        tier: Tier,
        medium: str,
        coords: RequestCoords | None,
        prefix_hit: bool = False,
    ) -> None:
        """Blocks became resident on `tier` (or, with prefix_hit, were reused)
        by a request with `coords` (None: a tier store with no request)."""
        if not hashes:
            return
        self.resident[tier].update(dict.fromkeys(hashes))
        others = False
        if coords:
            # A new node starts with the tiers its block already has copies on; with no copies
            # on any other tier (an engine without lower tiers) that is this tier alone.
            others = any(blocks for t, blocks in self.resident.items() if t is not tier)
            self.index.record_chain(hashes, first_position, parent, tier, coords, self.wall(), self.tiers_of if others else None)
            members = self.index.members(hashes[-1], first=coords.session_id)
            coordinates = Coordinates(coords.session_id or "", coords.continuation_id or "", members)
        else:
            # No session: only blocks the index already tracks change (a copy
            # of a session's block re-appearing keeps the session accurate).
            mark_resident = self.index.mark_resident
            tracked = [h for h in hashes if mark_resident(h, tier)]
            members = self._members(tracked[-1]) if tracked else ()
            coordinates = Coordinates("", "", members) if members else NO_COORDINATES
        sessions = members if not coordinates.session_id else (coordinates.session_id, *members)
        tenants = None
        if self.router is not None:
            # The event names at most MAX_MEMBERS_REPORTED members of its last block. A prefix
            # hit is news to the session it names first (the copies were resident, and shown to
            # their members' tenants when stored). A new copy is news to every member of every
            # block stored: usually the storing session alone, but a block whose copy on another
            # tier kept it in the index keeps its members, and a tier's copy names no request.
            tenants = self.router.tenants_of(sessions) if prefix_hit else self._tenants_of_blocks(hashes)
            if tenants:
                self._note_shown(hashes, tenants, coordinates.session_id)
        self.bus.publish(
            BlocksStored(
                tier=tier,
                medium=medium,
                block_hashes=tuple(hashes),
                parent=parent,
                first_position=first_position,
                block_size=self.info.block_size,
                coordinates=coordinates,
                prefix_hit=prefix_hit,
            ),
            sessions=sessions,
            tier=tier,
            tenants=tenants,
        )
        if others and self.router is not None and coordinates.session_id:
            self._show_copies(hashes, tier, first_position, parent, coordinates, sessions)
        index, config = self.index, self.config
        if (
            len(index.nodes) > config.max_index_blocks
            or len(index.sessions) > config.max_index_sessions
            or len(index.continuations) > config.max_index_continuations
        ):
            self._trim_index()  # after the BlocksStored: its MembershipChanged events come later

    def tiers_of(self, h: bytes) -> int:
        """Tier bitmask of the published copies of `h`."""
        mask = 0
        for t, blocks in self.resident.items():
            if h in blocks:
                mask |= t.bit
        return mask

    def on_removed(
        self,
        hashes: Sequence[bytes],
        *,
        tier: Tier,
        medium: str,
        cause: RemovalCause,
        remaining_tiers: Callable[[bytes], int] | None = None,
        grants_dropped: bool = False,
    ) -> None:
        """The last copy on `tier` of each block is gone. Publishes one
        BlocksRemoved per run of blocks with the same admitting coordinates.
        Device blocks' grants end here unless `grants_dropped` (the engine
        thread ended them already: `drop_grants`)."""
        if not hashes:
            return
        if tier is Tier.DEVICE and not grants_dropped:
            self.end_device_grants(hashes, cause, remaining_tiers)
        elif tier.bit & self.lower_retention_tiers and self.ledger.grants:
            # A lower tier that honours retention lost its copy: a grant that outlived the
            # device copy (end_device_grants) ends unless another copy it protects remains.
            mask, grants = self.retention_tiers, self.ledger.grants
            self.drop_grants([
                h for h in hashes if h in grants and not (remaining_tiers(h) & mask if remaining_tiers else 0)
            ])
        block_size = self.info.block_size
        nodes = self.index.nodes
        mark_removed = self.index.mark_removed
        router = self.router
        resident = self.resident[tier]
        for h in hashes:
            resident.pop(h, None)
        # (run key without the tenants, removal of the run's first block, hashes, prefix tokens,
        # with tenancy the tenants beyond the named sessions' that the run's removal reaches)
        runs: list[tuple[object, Removal | None, list[bytes], list[int], frozenset[str] | None]] = []
        last_key: object = None
        run_hashes: list[bytes] = []
        run_tokens: list[int] = []
        for h in hashes:
            node = nodes.get(h)
            extra = None if router is None else self._removal_tenants(h, node)
            removal = None if node is None else mark_removed(h, tier)
            if removal is None:
                base: object = remaining_tiers(h) == 0 if remaining_tiers else True
                tokens = 0
            else:
                base = removal[2:]  # (last_copy, admit_session, admit_continuation, sessions)
                tokens = (removal.position + 1) * block_size
            key = base if extra is None else (base, extra)
            if runs and key == last_key:
                run_hashes.append(h)
                run_tokens.append(tokens)
            else:
                run_hashes, run_tokens = [h], [tokens]
                runs.append((base, removal, run_hashes, run_tokens, extra))
                last_key = key
        shown = self._shown_tenants
        if shown:
            for h in hashes:
                if h in shown and not self.tiers_of(h):
                    del shown[h]  # gone everywhere
        for base, removal, run, prefix_tokens, extra in runs:
            if removal is None:
                coords, last_copy = NO_COORDINATES, bool(base)
            else:
                coords = Coordinates(removal.admit_session or "", removal.admit_continuation or "", removal.sessions)
                last_copy = removal.last_copy
            sessions = coords.members if not coords.session_id else (coords.session_id, *coords.members)
            self.bus.publish(
                BlocksRemoved(tier, medium, tuple(run), tuple(prefix_tokens), coords, cause, last_copy),
                sessions=sessions,
                tier=tier,
                tenants=None if extra is None or router is None else extra | router.tenants_of(sessions),
            )

    def _removal_tenants(self, h: bytes, node: Node | None) -> frozenset[str] | None:
        """With tenancy, before a copy of `h` is marked removed: the tenants its removal must
        reach besides those of the sessions the event names (at most MAX_MEMBERS_REPORTED
        members): every member's when it has more, and those whose sessions left it while it
        stayed resident or were shown it stored (`_note_shown`). None: the named sessions'
        alone. O(members) for a block with more."""
        assert self.router is not None
        extra = self._shown_tenants.get(h)
        members = node.members if node is not None else None
        if members.__class__ is set and len(members) > MAX_MEMBERS_REPORTED:  # type: ignore[arg-type]
            wide = self.router.tenants_of(members)  # type: ignore[arg-type]
            extra = wide if extra is None else extra | wide
        return extra

    def on_cleared(self, tier: Tier, grants_dropped: bool = False) -> None:
        self.resident[tier].clear()
        sessions = self.index.clear_tier(tier)
        if tier is Tier.DEVICE and not grants_dropped:
            self.clear_grants()
        elif tier.bit & self.lower_retention_tiers and self.ledger.grants:
            device = self.resident[Tier.DEVICE]  # grants that outlived their device copy end with the tier's
            self.drop_grants([h for h in self.ledger.grants if h not in device])
        shown = self._shown_tenants
        if shown:
            for h in [h for h in shown if not self.tiers_of(h)]:
                del shown[h]
        self.bus.publish(AllBlocksCleared(tier), sessions=sorted(sessions), tier=tier)

    def on_pin_broken(self, hashes: Sequence[bytes], shortfall_blocks: int, sessions: Sequence[str] | None = None) -> None:
        """Pinned blocks are about to be evicted to serve an allocation. Their grants end here,
        unless the engine thread ended them already and passes what `drop_grants` returned for
        them as `sessions`. With tenancy, each tenant whose grant broke (whatever its owner
        key: session, continuation or block hashes) is shown the event with its own blocks
        alone (PinBroken.tenant_blocks); a plain list of sessions, which says nothing of the
        owners, reaches only subscriptions without a tenant's scope."""
        if sessions is None:
            sessions = self.drop_grants(hashes)
        router, tenant_blocks = self.router, ()
        if router is not None and isinstance(sessions, EndedGrants):
            tenant_blocks = router.pin_broken(hashes, sessions.owners)
        self.bus.publish(
            PinBroken(tuple(hashes), tuple(sessions), shortfall_blocks, tenant_blocks),
            sessions=sessions,
            tenants=None if router is None else frozenset(name for name, _ in tenant_blocks),
        )

    def on_transfer(
        self, hashes: Sequence[bytes], from_tier: Tier, to_tier: Tier, bytes_moved: int, operation_id: str = ""
    ) -> None:
        members = self._members(hashes[-1]) if hashes else ()
        self.bus.publish(
            TierTransferCompleted(from_tier, to_tier, tuple(hashes), bytes_moved, operation_id, Coordinates("", "", members)),
            sessions=members,
            tier=to_tier,
            tenants=None if self.router is None else self._tenants_of_blocks(hashes),
        )

    def _show_copies(
        self, hashes: Sequence[bytes], tier: Tier, first_position: int, parent: bytes | None,
        coordinates: Coordinates, sessions: tuple[str, ...],
    ) -> None:
        """With tenancy, after a session joined `hashes` on `tier` (a prefix hit or a store):
        tell its tenant of the blocks' copies on other tiers, a BlocksStored with prefix_hit per
        tier and run of consecutive blocks, tagged for that tenant alone. A copy is shown to the
        tenants of its block's members when it is made, so one made before any of the tenant's
        sessions joined never reached the tenant's followers; and a follower whose snapshot was
        begun when the tenant's session left a block (the index forgot it) and ended after, got
        neither the chunk nor the copies. A follower that holds them already gets a duplicate.
        O(blocks), only while a lower tier holds anything; its session is a member now, so the
        copies' removals reach the tenant."""
        router = self.router
        assert router is not None
        tenant = router.tenant_of(coordinates.session_id)
        if tenant is None:
            return
        masks = [self.tiers_of(h) & ~tier.bit for h in hashes]
        if not any(masks):
            return
        only = frozenset((tenant,))
        media = {t.tier: t.medium for t in self.info.tiers}
        for t in Tier:
            i = 0
            for held, run in itertools.groupby(masks, key=lambda mask: bool(mask & t.bit)):  # noqa: B023 (used at once)
                j = i + sum(1 for _ in run)
                if held:
                    self.bus.publish(
                        BlocksStored(t, media.get(t, ""), tuple(hashes[i:j]), hashes[i - 1] if i else parent, first_position + i,
                                     self.info.block_size, coordinates, True),
                        sessions=sessions, tier=t, tenants=only,
                    )
                i = j

    def _tenants_of_blocks(self, hashes: Sequence[bytes]) -> frozenset[str]:
        """With tenancy: the tenants of every member of every one of `hashes` (an event that names
        at most MAX_MEMBERS_REPORTED members of one of them must still reach them all).
        O(members) per block with a member set, as a removal's tag (`_removal_tenants`); the walk
        stops once every tenant is found."""
        router = self.router
        assert router is not None
        nodes = self.index.nodes

        def ids() -> Iterator[str]:
            last = None  # a chain's blocks mostly share their one member: asked once
            for h in hashes:
                node = nodes.get(h)
                members = None if node is None else node.members
                if members.__class__ is str:
                    if members != last:
                        last = members
                        yield members  # type: ignore[misc]
                elif members is not None:
                    yield from members  # type: ignore[misc]

        return router.tenants_of(ids())

    def _trim_index(self) -> None:
        """Forget the least recently active sessions (and, for the block bound, continuations
        recorded longer ago: SessionPrefixIndex.forget_least_active) until the index is at 90%
        of max_index_blocks and of max_index_sessions, and the oldest continuations until 90% of
        max_index_continuations remain (their blocks stay cached, anonymously). Sessions and
        continuations, not only blocks: every session that reads a hot shared prefix is a
        member of its blocks, which are rarely evicted, so without their own bound they would
        accumulate while the block count stays small. A continuation holds its blocks whether
        or not a session does: with sessions alone, blocks continuations held kept the index
        over its block bound, and every later store forgot every live session."""
        index, config = self.index, self.config
        forgotten = dropped = 0
        if len(index.nodes) > config.max_index_blocks or len(index.sessions) > config.max_index_sessions:
            forgotten, dropped = index.forget_least_active(
                int(config.max_index_blocks * 0.9), int(config.max_index_sessions * 0.9), LeaveCause.INDEX_LIMIT)
        if len(index.continuations) > config.max_index_continuations:
            excess = len(index.continuations) - int(config.max_index_continuations * 0.9)
            dropped += index.forget_oldest_continuations(excess)
        log.warning(
            "kvhint: index over its bounds (%d blocks, %d sessions, %d continuations); forgot %d least recently "
            "active sessions and %d continuations", config.max_index_blocks, config.max_index_sessions,
            config.max_index_continuations, forgotten, dropped,
        )

    def _members(self, h: bytes) -> tuple[str, ...]:
        return self.index.members(h)

    def _on_leave(self, session: str, blocks: tuple[bytes, ...], cause: LeaveCause) -> None:
        """Index listener: a forgotten session left blocks that stay resident."""
        tenant = self.router.tenant_of(session) if self.router is not None else None
        if tenant is not None:  # its follower keeps the blocks: their removal must reach it
            only = frozenset((tenant,))
            for h in blocks:
                self._add_shown(h, only)
        self.bus.publish(MembershipChanged(session, blocks, cause), sessions=(session,))

    def _note_shown(self, hashes: Sequence[bytes], tenants: frozenset[str], session: str) -> None:
        """With tenancy, as a BlocksStored tagged `tenants` is published: their followers hold
        every one of `hashes` resident on its tier now. Remember the tenants that have no member
        of a block, so that its removal reaches them. `session`: the storing session ("": none),
        a member of every one of them. Per block, its members are walked until the other
        tenants named are found among them (O(members) for a block one of them is not on)."""
        router = self.router
        assert router is not None
        own = router.tenant_of(session) if session else None
        rest = tenants - {own} if own in tenants else tenants
        if not rest:
            return  # the usual store: one tenant's session, now a member of every block
        nodes = self.index.nodes
        for h in hashes:
            node = nodes.get(h)
            members = None if node is None else node.members
            missing = rest if members is None else router.absent(rest, (members,) if members.__class__ is str else members)  # type: ignore[arg-type]
            if missing:
                self._add_shown(h, missing)

    def _add_shown(self, h: bytes, tenants: frozenset[str]) -> None:
        shown = self._shown_tenants
        before = shown.get(h)
        shown[h] = tenants if before is None or before == tenants else before | tenants


class EndedGrants(list[str]):
    """The grants `drop_grants` / `end_device_grants` ended: the sessions of their owners (the
    list itself, first seen first, as the event filters know them) and `owners`, block ->
    the owner keys whose grant on it ended (which tenants' grants a PinBroken broke)."""

    __slots__ = ("owners",)

    def __init__(self) -> None:
        super().__init__()
        self.owners: dict[bytes, tuple[str, ...]] = {}

    def add(self, h: bytes, owners: tuple[str, ...]) -> None:
        """`owners`' grants on `h` ended."""
        if not owners:
            return
        before = self.owners.get(h)
        self.owners[h] = owners if before is None else before + owners
        for owner in owners:
            s = session_of_owner(owner)
            if s is not None and s not in self:
                self.append(s)
