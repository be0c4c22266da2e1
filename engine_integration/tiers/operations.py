"""TierOperations: the Demote / Prefetch / Share state machine (engine thread).

An operation starts in `start()` (from `VllmAdapter.start_tier_task`), then
progresses in `on_step()` (every `schedule()`): COPY while the engine makes
copies valid on the target tier, REMOTE while a Share worker waits for the
destination, DONE once completed. Every operation completes exactly once
(`OperationRegistry.complete`) and has a deadline, so none can hang. A step
of progress returns `None` (keep going) or a `Failure`.

What each action does:

* Demote{target HOST|DISK}: blocks whose host copy is READY need nothing;
  blocks whose host store is in flight are waited for; blocks only in G1 (for
  example decode blocks: the connector offloads prompt blocks only) are copied
  by an injected store job (`TierControl.force_store`). For target DISK the
  file-tier copy is waited for (host -> file cascades are automatic; a READY
  host copy without a file is cascaded explicitly). When every selected block
  has a valid copy on the target tier the operation SUCCEEDS, a
  TierTransferCompleted is published, and only then the G1 copies become the
  first eviction candidates (`demote_first`): copy completion and reclamation
  are separate steps. G1 copies stay reusable until a later allocation takes
  them.
* Prefetch: the connector loads into G1 only for a request it is admitting, so
  Prefetch stages copies in the host tier: file-only blocks are promoted
  file -> host (`control.Prefetch`), host copies are refreshed to
  most-recently-used, and the resume request then loads from host memory.
* Share{destination}: every selected block is made valid in the shared file
  tier (as for Demote to DISK), hash aliases are written beside the files,
  then a worker thread has the destination Prefetch them (`share.SharePeers`).
"""

from __future__ import annotations

import enum
import itertools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.kv_offload.base import ReqContext

from kvhint_server.adapter import TierRefusal, TierTask
from kvhint_server.model import Action, Reason, Tier

from .. import vllm_private
from .control import HostState, Prefetch, StoreOp, TierControl
from .feed import ResidencyFeed
from .hashes import HashBook
from .settings import TierSettings
from .share import SharePeers, ShareOutcome

log = logging.getLogger("kvhint.tiers")

MAX_PENDING_OPS = 64
MAX_STORE_RETRIES = 3
HOST_FULL_GRACE_S = 1.0  # how long a store or promotion waits for host room with no tier work in flight
REMOTE_BACKSTOP_S = 30.0  # the Share worker enforces the deadline; this is a backstop
_ids = itertools.count()


class Phase(enum.Enum):
    COPY = "copy"        # engine side: make copies valid on the target tier
    REMOTE = "remote"    # Share: a worker thread waits for the destination
    DONE = "done"


@dataclass(frozen=True)
class Failure:
    """Why an operation cannot go on. At start it becomes the hint's refusal."""

    reason: Reason
    message: str


@dataclass
class TierOp:
    op_id: str
    action: Action
    target: Tier
    exts: tuple[bytes, ...]          # wire hashes, chain order
    digests: list[bytes]             # vLLM block hashes (offload key without group)
    deadline: float                  # monotonic
    phase: Phase = Phase.COPY
    store: StoreOp | None = None
    store_tries: int = 0
    full_since: float | None = None  # monotonic: while no host room, the last step that saw tier work in flight
    prefetch: Prefetch | None = None
    cascaded: set[bytes] = field(default_factory=set)
    # Copies, one per KV-cache group of a block (bytes_per_block is one copy's bytes).
    stored_copies: int = 0           # G1 -> host copies this op made
    written_copies: int = 0          # host -> file copies this op caused
    promoted: list[bytes] = field(default_factory=list)  # file -> host (Prefetch): blocks
    promoted_copies: int = 0         # file -> host copies (Prefetch)
    destination: str = ""
    address: str = ""


class TierOperations:
    def __init__(
        self,
        core: Any,
        ctl: TierControl,
        book: HashBook,
        feed: ResidencyFeed,
        settings: TierSettings,
        *,
        bytes_per_block: int,
        demote_first: Callable[[tuple[bytes, ...]], list[bytes]],
        wake: Callable[[], None],
    ) -> None:
        self.core = core
        self.ctl = ctl
        self.book = book
        self.feed = feed
        self.settings = settings
        self.bytes_per_block = bytes_per_block
        self._demote_first = demote_first
        self._wake = wake
        self.has_file = bool(ctl.file_tiers)
        self._ops: dict[str, TierOp] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._peers = SharePeers(core.config.auth_token)
        self.closed = False

    def needs_steps(self) -> bool:
        return any(op.phase is Phase.COPY for op in self._ops.values())

    # ------------------------------------------------------------ start

    def start(self, task: TierTask) -> TierRefusal | None:
        """Engine thread. None when the operation started; otherwise why it
        cannot (the executor answers REJECTED with that reason)."""
        if self.closed:
            return TierRefusal(Reason.SHUTTING_DOWN, "the engine is shutting down")
        if len(self._ops) >= MAX_PENDING_OPS:
            return TierRefusal(Reason.RESOURCE_EXHAUSTED, f"{len(self._ops)} tier operations already in flight (limit {MAX_PENDING_OPS})")
        exts = tuple(dict.fromkeys(task.block_hashes))
        maybe = [self.book.digest_of(h) for h in exts]
        unknown = sum(d is None for d in maybe)
        if unknown:
            return TierRefusal(Reason.NOT_RESIDENT, f"{unknown} of {len(exts)} selected blocks have no known content hash on this engine")
        digests = [d for d in maybe if d is not None]
        planned = self._plan(task, exts, digests)
        if isinstance(planned, TierRefusal):
            return planned
        target, timeout = planned
        op = TierOp(task.operation_id, task.hint.action, target, exts, digests, time.monotonic() + timeout)
        if op.action is Action.SHARE:
            op.destination, op.address = task.hint.destination, self.settings.peers[task.hint.destination]
        self._ops[op.op_id] = op
        self.core.operations.running(op.op_id)
        try:
            failure = self._progress(op, starting=True)
        except BaseException:
            # The error reaches the executor, which rejects the hint (OPERATION_FAILED) and
            # discards the operation: nothing of it may go on (copies, transfer events, steps).
            self._abandon(op)
            raise
        if failure is not None:
            self._abandon(op)
            return TierRefusal(Reason.RESOURCE_EXHAUSTED, failure.message)
        self._wake()
        return None

    def _abandon(self, op: TierOp) -> None:
        """An operation whose start failed: forgotten, its promotion round closed, its injected
        store (not handed to the workers before the next step) dropped."""
        del self._ops[op.op_id]
        self._cleanup(op)
        if op.store is not None:
            self.ctl.cancel_store(op.store)

    def _plan(self, task: TierTask, exts: tuple[bytes, ...], digests: list[bytes]) -> tuple[Tier, float] | TierRefusal:
        """The target tier and timeout of a new operation, or why it cannot start."""
        hint = task.hint
        action = hint.action
        cap = self.ctl.host_capacity()
        timeout = self.settings.op_timeout_s
        if action is Action.DEMOTE:
            target = hint.target_tier or Tier.HOST
            if target is Tier.DISK and not self.has_file:
                return TierRefusal(Reason.UNSUPPORTED, "no file tier is configured")
            if len(exts) > cap:
                return TierRefusal(Reason.RESOURCE_EXHAUSTED, f"host tier holds {cap} blocks; Demote selected {len(exts)} (use max_blocks)")
            return target, timeout
        if action is Action.PREFETCH:
            need = sum(not self.ctl.g1_has(d) for d in digests)
            if need > cap:
                return TierRefusal(Reason.RESOURCE_EXHAUSTED, f"host tier holds {cap} blocks; Prefetch needs to stage {need} (use max_blocks)")
            return Tier.HOST, hint.deadline_s if hint.deadline_s is not None else timeout
        if action is Action.SHARE:
            if not self.has_file:
                return TierRefusal(Reason.UNSUPPORTED, "Share needs a shared file tier")
            if hint.destination not in self.settings.peers:
                return TierRefusal(Reason.UNKNOWN_DESTINATION, f"destination {hint.destination!r} is not a configured peer")
            if len(exts) > cap:
                return TierRefusal(Reason.RESOURCE_EXHAUSTED, f"host tier holds {cap} blocks; Share selected {len(exts)} (use max_blocks)")
            return Tier.DISK, timeout
        return TierRefusal(Reason.UNSUPPORTED, f"{action.name} is not a tier action")

    # ------------------------------------------------------------ progress

    def on_step(self) -> None:
        """Engine thread, every schedule(): progress and complete operations."""
        if not self._ops:
            return
        now = time.monotonic()
        for op in list(self._ops.values()):
            if op.phase is Phase.DONE:
                self._ops.pop(op.op_id, None)
                continue
            if op.phase is Phase.REMOTE:
                if now > op.deadline + REMOTE_BACKSTOP_S:
                    self.fail(op, Failure(Reason.DEADLINE_EXCEEDED, "destination did not answer in time"))
                continue
            if now > op.deadline:
                self.fail(op, Failure(Reason.DEADLINE_EXCEEDED, f"{op.action.name} did not complete before its deadline"))
                continue
            try:
                failure = self._progress(op)
            except Exception as exc:  # noqa: BLE001
                log.exception("kvhint tiers: operation %s failed", op.op_id)
                failure = Failure(Reason.OPERATION_FAILED, f"{type(exc).__name__}: {exc}")
            if failure is not None:
                self.fail(op, failure)

    def _progress(self, op: TierOp, starting: bool = False) -> Failure | None:
        if op.action is Action.PREFETCH:
            return self._progress_prefetch(op, starting)
        return self._progress_copy(op, starting)

    def _store_missing(self, op: TierOp, missing: list[bytes], landed: list[bytes]) -> Failure | None:
        """Store `missing` (no host copy) without evicting the copies of `landed`, the
        operation's other blocks."""
        if op.store is not None and not op.store.done:
            return None
        if op.store_tries >= MAX_STORE_RETRIES:
            return Failure(Reason.RESOURCE_EXHAUSTED, "host tier keeps evicting the copies (too small for the working set)")
        # The copies made so far are kept: room made by evicting them would only
        # have to be stored again (a Demote of a full tier's worth chased its tail).
        store = self.ctl.force_store(missing, keep=landed)
        if store.failed:
            op.store = None  # no evictable chunk now: try again while the room may come back
            if self._wait_for_room(op):
                return None
            return Failure(Reason.RESOURCE_EXHAUSTED, f"host tier is full: {store.failed} ({self._host_usage()})")
        op.full_since = None
        op.store_tries += 1
        op.store = store
        op.stored_copies += store.copies
        if self.has_file and op.target is Tier.DISK:
            # complete_store cascades them to the file tier: part of this operation's bytes only
            # when the file tier is its target (a host-tier Demote moved them device -> host).
            op.written_copies += store.copies
        return None

    def _wait_for_room(self, op: TierOp) -> bool:
        """`op` found no evictable host chunk (a store refused, a promotion answered MISS):
        whether to try again on a later step. Yes while the tier has work in flight, whose
        chunks come back when it lands, and for HOST_FULL_GRACE_S after the last step that
        saw such work (a load pins chunks invisibly); no after that. The operation's deadline
        bounds the wait either way."""
        now = time.monotonic()
        if self.ctl.host_work_in_flight() or op.full_since is None:
            op.full_since = now
        return now - op.full_since < HOST_FULL_GRACE_S

    def _progress_copy(self, op: TierOp, starting: bool) -> Failure | None:
        """Demote and Share: every selected block valid on op.target."""
        ctl = self.ctl
        want_file = op.target is Tier.DISK
        missing, lost, not_ready = [], [], 0
        cascade: list[bytes] = []
        inflight = vllm_private.inflight_file_writes(ctl.manager) if want_file else set()
        for e, d in zip(op.exts, op.digests):
            if want_file and self.feed.file_settled(e, d, inflight, recheck=starting):
                continue
            st = ctl.host_state(d)
            if st is HostState.READY and ctl.host_lacks(d, g1=True):
                # A copy only the device holds (a window tail the host evicted): stored too,
                # or a resume from the host would find the block but not its window.
                not_ready += 1
                missing.append(d)
                continue
            if st is HostState.READY:
                if want_file:
                    not_ready += 1
                    in_flight = any(ctl.key(d, g) in inflight for g in ctl.group_ids)
                    if d not in op.cascaded and not in_flight and not ctl.file_has(d):
                        cascade.append(d)
                continue
            not_ready += 1
            if st is HostState.PENDING:
                continue
            if ctl.g1_has(d):
                missing.append(d)
            else:
                lost.append(e)
        if lost and not (op.store is not None and not op.store.done):
            return Failure(Reason.OPERATION_FAILED, f"{len(lost)} of {len(op.exts)} blocks left every tier before a copy was made")
        if missing:
            # Most-recently-used first, so the host LRU does not make room for the
            # missing copies by evicting this operation's ready ones.
            absent = set(missing)
            landed = [d for d in op.digests if d not in absent]
            ctl.touch_host(landed)
            # Kept from eviction by the store: the copies landed so far, including those of the
            # blocks it completes (a block whose window copy alone is missing).
            failure = self._store_missing(op, missing, op.digests)
            if failure is not None:
                return failure
        if cascade:
            op.written_copies += self._force_cascade(cascade)
            op.cascaded.update(cascade)
        if not_ready or starting:
            return None
        # Every selected block has a valid copy on the target tier.
        bpb = self.bytes_per_block
        if op.action is Action.DEMOTE:
            moved = (op.stored_copies + op.written_copies) * bpb
            self.core.on_transfer(list(op.exts), Tier.DEVICE, op.target, moved, op.op_id)
            self._complete(op, {op.target: len(op.exts)}, moved)
            self.book.mark_demoted(op.exts)
            # Reclamation is a separate, later step: the G1 copies become the first
            # eviction candidates now (tail first), and go when room is needed.
            self._demote_first(op.exts)
            return None
        # Share: the shared tier holds everything; hand over to the destination.
        written = (op.stored_copies + op.written_copies) * bpb
        if written:
            self.core.on_transfer(list(op.exts), Tier.HOST, Tier.DISK, written, op.op_id)
        op.phase = Phase.REMOTE
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvhint-share")
        self._pool.submit(self._share_worker, op, written)
        return None

    def _force_cascade(self, digests: list[bytes]) -> int:
        """Write READY host copies to the file tier(s) now (the cascade the tiering
        manager runs after a store; the chunks are pinned until the write finishes).
        Returns how many copies it writes."""
        mgr = self.ctl.manager
        keys = self.ctl.host_keys(digests)  # every group's host copy there is (window groups: tails)
        ctx = ReqContext(req_id=f"kvhint-cascade-{next(_ids)}")
        for idx, tier in enumerate(mgr.secondary_tiers):
            if tier in self.ctl.file_tiers:
                tier.submit_store(mgr.create_store_job(keys, ctx, idx))
        return len(keys)

    def _progress_prefetch(self, op: TierOp, starting: bool) -> Failure | None:
        ctl = self.ctl
        if starting:
            to_promote, there = [], []
            for e, d in zip(op.exts, op.digests):
                if ctl.g1_has(d):
                    continue
                if ctl.host_state(d) is not HostState.ABSENT:
                    there.append(d)
                    if ctl.host_lacks(d, files=True):  # a window tail only a file holds
                        to_promote.append(d)
                elif self.feed.file_has(e, d):
                    to_promote.append(d)
            if to_promote:
                # The selection's copies already on the host tier first in LRU order, those of
                # the blocks being promoted included (a block's full-attention copy there while
                # its window copy comes): the promotions make their room by evicting
                # least-recent chunks, and these are wanted as much as the ones promoted (later
                # rounds touch what is staged).
                ctl.touch_host(there + to_promote)
                op.prefetch = Prefetch(ctl, to_promote)
            return None
        pf = op.prefetch
        if pf is not None and not pf.closed:
            pf.poll()
            if not pf.closed:
                return None
        if pf is not None:
            # Progress is a copy promoted, not a hit: on a hybrid model a block whose full-attention
            # copy is on the host is a hit every round while its window copy finds no room, and
            # counting it kept the wait from ever ending before the deadline.
            moved = pf.promoted_blocks
            op.promoted.extend(h for h in pf.hits if h in moved)
            op.promoted_copies += pf.promoted_copies
            op.prefetch = None
            if pf.promoted_copies:
                op.full_since = None  # progress: a later MISS starts its own wait
        staged, waiting, absent = [], 0, []
        for d in op.digests:
            if ctl.g1_has(d):
                continue
            st = ctl.host_state(d)
            if st is HostState.READY and ctl.host_lacks(d, files=True):
                absent.append(d)  # staged without a window tail a file holds: promoted again
            elif st is HostState.READY:
                staged.append(d)
            elif st is HostState.PENDING:
                waiting += 1
            else:
                absent.append(d)
        # Staged copies first in LRU order: later promotions must not evict them.
        ctl.touch_host(staged)
        if waiting:
            return None
        # A promotion answers MISS when the host tier has no evictable chunk at that
        # moment (chunks pinned by file writes in flight, or just stored by a request
        # that has not finished yet): retry as a store does (`_wait_for_room`), then fail.
        retry = [d for d in absent if ctl.file_has(d)]
        if retry and self._wait_for_room(op):
            op.prefetch = Prefetch(ctl, retry)
            return None
        lost = len(absent)
        promoted = list(dict.fromkeys(op.promoted))
        moved = op.promoted_copies * self.bytes_per_block
        if promoted:
            ext_of = {d: e for e, d in zip(op.exts, op.digests)}
            self.core.on_transfer([ext_of[d] for d in promoted], Tier.DISK, Tier.HOST, moved, op.op_id)
        if lost:
            full = ctl.host_used() >= ctl.host_capacity()
            reason = Reason.RESOURCE_EXHAUSTED if full else Reason.OPERATION_FAILED
            why = (f"the host tier is full ({self._host_usage()})" if full
                   else "they are on no lower tier")
            self._complete(op, {Tier.HOST: len(staged)}, moved, ok=False, reason=reason,
                           message=f"{lost} of {len(op.exts)} blocks could not be staged: {why}")
            return None
        self._complete(op, {Tier.HOST: len(staged)}, moved)
        return None

    def _host_usage(self) -> str:
        p = self.ctl.primary
        evictable, written = vllm_private.host_chunks_evictable(p), vllm_private.host_chunks_being_written(p)
        return (f"{self.ctl.host_used()} of {self.ctl.host_capacity()} chunks in use, "
                f"{'?' if evictable is None else evictable} evictable, "
                f"{'?' if written is None else written} being written; "
                f"{vllm_private.file_transfers_in_flight(self.ctl.manager)} file transfers in flight")

    # ------------------------------------------------------------ Share

    def _share_worker(self, op: TierOp, written: int) -> None:
        """Worker thread: aliases, then the destination's Prefetch; result back to the engine thread."""
        try:
            if self.book.int_hashes:
                self.book.write_aliases(op.exts, op.digests)
            outcome = self._peers.prefetch_on(op.destination, op.address, op.op_id, op.exts, op.deadline,
                                              lambda: self.closed)
        except Exception as exc:  # noqa: BLE001 - reported on the operation
            outcome = ShareOutcome(False, Reason.OPERATION_FAILED, f"writing hash aliases failed: {exc}")
        try:
            self.core.submit(lambda: self._finish_share(op, outcome, written))
        except Exception:  # noqa: BLE001 - engine stopped: shutdown() failed the op
            pass

    def _finish_share(self, op: TierOp, outcome: ShareOutcome, written: int) -> None:
        if op.phase is Phase.DONE:
            return
        moved = written + outcome.remote_bytes
        if outcome.ok:
            self.core.on_transfer(list(op.exts), Tier.DISK, Tier.REMOTE, outcome.remote_bytes, op.op_id)
            self._complete(op, {Tier.DISK: len(op.exts), Tier.REMOTE: outcome.remote_blocks}, moved,
                           message=f"visible on {op.destination}")
        else:
            self._complete(op, {Tier.DISK: len(op.exts)}, moved, ok=False, reason=outcome.reason,
                           message=outcome.message)

    # ------------------------------------------------------------ completion

    def _complete(self, op: TierOp, blocks: dict[Tier, int], moved: int, *, ok: bool = True,
                  reason: Reason = Reason.UNSPECIFIED, message: str = "") -> None:
        op.phase = Phase.DONE
        self._ops.pop(op.op_id, None)
        self._cleanup(op)
        self.core.operations.complete(op.op_id, ok=ok, reason=reason, message=message,
                                      blocks={t: n for t, n in blocks.items() if n}, bytes_moved=moved)

    def fail(self, op: TierOp, failure: Failure) -> None:
        moved = (op.stored_copies + op.written_copies) * self.bytes_per_block
        self._complete(op, {}, moved, ok=False, reason=failure.reason, message=failure.message)

    def fail_copying(self, failure: Failure) -> None:
        """Fail every operation still copying (the connector cache was reset)."""
        for op in list(self._ops.values()):
            if op.phase is Phase.COPY:
                self.fail(op, failure)

    def fail_storing(self, stores: list[StoreOp], failure: Failure) -> None:
        """Fail the operations whose injected store is one of `stores` (released at a device reset)."""
        for op in list(self._ops.values()):
            if op.phase is Phase.COPY and op.store is not None and any(op.store is s for s in stores):
                self.fail(op, failure)

    def _cleanup(self, op: TierOp) -> None:
        if op.prefetch is not None:
            op.prefetch.close()  # promotions already submitted finish on their own
        # An injected store in flight releases its G1 pins itself when the copy completes (or at a
        # device reset, TierControl.release_device_holds).

    def shutdown(self) -> None:
        """Fail what is pending (SHUTTING_DOWN), stop the share worker, close channels."""
        self.closed = True
        for op in list(self._ops.values()):
            self._complete(op, {}, 0, ok=False, reason=Reason.SHUTTING_DOWN, message="the engine is shutting down")
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._peers.close()
