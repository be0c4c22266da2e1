"""Scheduler-side control of vLLM's OffloadingConnector tiers (G2 host, G3 file).

Everything here runs inside EngineCore, in the scheduler thread, between
scheduler steps (e.g. from a `Scheduler` subclass before `super().schedule()`).
Construct one `TierControl(scheduler)` after the scheduler exists; it finds
`scheduler.connector` (an `OffloadingConnector`), its scheduler half
(`connector.connector_scheduler`, an `OffloadingConnectorScheduler`) and the
`OffloadingManager` behind it (`connector_scheduler.manager`): either a
`CPUOffloadingManager` (host tier only) or a `TieringOffloadingManager`
(`.primary_tier` host tier + `.secondary_tiers`, e.g. the `fs` file tier).

Read-only queries (`host_state`, `file_has`, `g1_has`, `residency`) use only
side-effect-free calls. NOTE: `TieringOffloadingManager.lookup` is NOT a pure
query: on a primary miss and a secondary hit it starts a promotion into the
host tier. Use `Prefetch` when that is what you want.

Actions:
  * `demote_check(hashes)`   which blocks already have a valid G2 copy (Demote's
                             precondition); the rest are pending or missing.
  * `force_store(hashes)`    EXPERIMENTAL: copy G1 blocks that have no G2 copy to
                             the host tier without a request, by injecting a store
                             job into the connector (private internals, see
                             README). Completes one or two steps later.
  * `Prefetch(ctl, hashes)`  file tier -> host tier warm-up without a request.
  * `file_has(hashes)`       Share: completion on the writer, visibility on the reader.
  * `tap_events(callback)`   see connector residency events (BlockStored /
                             BlockRemoved, medium "CPU" / "STORAGE") before vLLM
                             publishes them.
Host tier -> G1 needs a request (see README): use a max_tokens=1 request
carrying the prefix tokens.

The engine must keep stepping while an operation is in flight even if no
request is running. `install()` (called by `force_store`, `Prefetch`,
`tap_events`) wraps `connector.has_pending_push_work`, which vLLM's
`Scheduler.has_requests()` already consults, so `EngineCore.has_work()` stays
True while `ctl.busy()`. An idle EngineCore blocks in `input_queue.get()`, so
whoever starts an operation from another thread must wake it (any client
request / utility call does).
"""

from __future__ import annotations

import enum
import itertools
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
    TransferJob,
)
from vllm.v1.kv_offload.base import (
    GPULoadStoreSpec,
    LookupResult,
    OffloadKey,
    ReqContext,
    make_offload_key,
)

from .. import vllm_private

BlockHash = bytes
_ids = itertools.count()


class HostState(enum.Enum):
    READY = "ready"      # valid, loadable copy on the host tier
    PENDING = "pending"  # slot allocated, store (or promotion) still in flight
    ABSENT = "absent"


@dataclass
class DemoteReport:
    ready: list[BlockHash] = field(default_factory=list)    # G2 copy valid: G1 may be reclaimed now
    pending: list[BlockHash] = field(default_factory=list)  # G2 store in flight: wait (CPU BlockStored)
    missing: list[BlockHash] = field(default_factory=list)  # only in G1: needs force_store (or recompute)
    lost: list[BlockHash] = field(default_factory=list)     # neither in G1 nor G2


@dataclass
class StoreOp:
    """One injected G1 -> host store (see `TierControl.force_store`)."""
    op_id: str
    hashes: list[BlockHash]                 # hashes actually being stored
    skipped_ready: list[BlockHash]          # already had a host copy (ready or pending)
    not_in_g1: list[BlockHash]              # no G1 block to copy from
    job_id: int | None = None
    done: bool = False
    failed: str | None = None               # reason, when the host tier could not take it
    evicted_keys: list[OffloadKey] = field(default_factory=list)
    _ctx: ReqContext | None = None
    _keys: list[OffloadKey] = field(default_factory=list)
    _blocks: list[Any] = field(default_factory=list)
    _job: TransferJob | None = None
    _pending_workers: int = 0
    # The connector's cache was reset while the copy was in flight (`drop_in_flight_stores`):
    # its keys belong to the manager before the reset, so the completion only unpins.
    _stale: bool = False
    on_done: Callable[["StoreOp"], None] | None = None

    @property
    def copies(self) -> int:
        """The copies the store makes (one per group of each block it stores)."""
        return len(self._keys)


class TierControl:
    def __init__(self, scheduler: Any):
        connector = getattr(scheduler, "connector", None)
        cs = getattr(connector, "connector_scheduler", None)
        if cs is None or not hasattr(cs, "manager"):
            raise ValueError("scheduler.connector is not an OffloadingConnector (scheduler role)")
        self.scheduler = scheduler
        self.connector = connector
        self.cs = cs                                   # OffloadingConnectorScheduler
        self.manager = cs.manager                      # OffloadingManager
        self.primary = getattr(self.manager, "primary_tier", self.manager)  # CPUOffloadingManager
        self.secondary_tiers = list(getattr(self.manager, "secondary_tiers", ()))
        self.file_tiers = [t for t in self.secondary_tiers if hasattr(t, "file_mapper")]
        self.group_ids = tuple(g.group_idx for g in cs.config.kv_group_configs)
        # The groups whose copies make a logical block present on a tier (`use_groups`; all
        # of them until told): on a hybrid model the full-attention groups. A sliding-window
        # group holds only window tails, on every tier, so a block lacking its window copy
        # is still a host or file block, as on the device (engine_integration/kv_groups.py).
        self.required_group_ids = self.group_ids
        self.blocks_per_chunk = cs.config.blocks_per_chunk
        self._probe = ReqContext(req_id="kvhint-probe")
        self._ops: dict[int, StoreOp] = {}
        self._prefetches: set[Prefetch] = set()
        self._event_taps: list[Callable[[list], None]] = []
        self._installed = False

    def use_groups(self, residency: Iterable[int]) -> None:
        """Define tier presence by these KV-cache groups (the adapter's residency groups)."""
        wanted = tuple(g for g in self.group_ids if g in set(residency))
        self.required_group_ids = wanted or self.group_ids

    # ---------------------------------------------------------------- keys
    def key(self, block_hash: BlockHash, group_idx: int = 0) -> OffloadKey:
        return make_offload_key(block_hash, group_idx)

    def block_hashes(self, token_ids: Sequence[int], extra_keys: Any = None) -> list[BlockHash]:
        """Block hashes of the full blocks of `token_ids` (same chain as vLLM's request hasher;
        only for plain-text requests without LoRA / mm / cache_salt)."""
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils as kcu

        cfg = self.scheduler.vllm_config.cache_config
        fn = get_hash_fn_by_name(cfg.prefix_caching_hash_algo)
        if not hasattr(kcu, "NONE_HASH"):
            kcu.init_none_hash(fn)
        bs = self.cs.config.tokens_per_hash
        out, parent = [], None
        for i in range(len(token_ids) // bs):
            parent = kcu.hash_block_tokens(fn, parent, token_ids[i * bs:(i + 1) * bs], extra_keys)
            out.append(parent)
        return out

    # ------------------------------------------------------------- queries
    def host_state(self, block_hash: BlockHash) -> HostState:
        """State of the host-tier (G2) copy; pure (CPUOffloadingManager.lookup is a dict get)."""
        states = {self.primary.lookup(self.key(block_hash, g), self._probe) for g in self.required_group_ids}
        if states == {LookupResult.HIT}:
            return HostState.READY
        if LookupResult.MISS in states:
            return HostState.ABSENT
        return HostState.PENDING

    def file_has(self, block_hash: BlockHash) -> bool:
        """A complete copy exists in some file tier (G3). Files are written as
        <name>.tmp then os.replace'd, so existence means the write completed."""
        return any(
            all(os.path.exists(t.file_mapper.get_file_name(self.key(block_hash, g))) for g in self.required_group_ids)
            for t in self.file_tiers
        )

    def host_lacks(self, block_hash: BlockHash, *, g1: bool = False, files: bool = False) -> list[int]:
        """The groups whose copy of the block the host tier has no entry for (lookup MISS; a
        store in flight is an entry) while the device pool (`g1`) or a file tier (`files`)
        holds one. On a hybrid model: the window tails a resume from the host reads, which
        `host_state` (the groups that define presence) does not look at. Pure."""
        pool = self.scheduler.kv_cache_manager.block_pool
        out = []
        for g in self.group_ids:
            key = self.key(block_hash, g)
            if self.primary.lookup(key, self._probe) is not LookupResult.MISS:
                continue
            if (g1 and pool.get_cached_block(block_hash, [g]) is not None) or (files and self.file_has_key(key)):
                out.append(g)
        return out

    def file_has_key(self, key: OffloadKey) -> bool:
        """Some file tier holds this one copy (see `file_has`)."""
        return any(os.path.exists(t.file_mapper.get_file_name(key)) for t in self.file_tiers)

    def g1_has(self, block_hash: BlockHash) -> bool:
        pool = self.scheduler.kv_cache_manager.block_pool
        return pool.get_cached_block(block_hash, list(self.required_group_ids)) is not None

    def host_keys(self, block_hashes: Iterable[BlockHash]) -> list[OffloadKey]:
        """The keys of every group's valid host copy of these blocks, group-major."""
        hashes = list(block_hashes)
        return [k for g in self.group_ids for h in hashes
                if self.primary.lookup(k := self.key(h, g), self._probe) is LookupResult.HIT]

    def residency(self, hashes: Iterable[BlockHash]) -> dict[BlockHash, set[str]]:
        out = {}
        for h in hashes:
            tiers = set()
            if self.g1_has(h):
                tiers.add("G1")
            if self.host_state(h) is HostState.READY:
                tiers.add("G2")
            if self.file_tiers and self.file_has(h):
                tiers.add("G3")
            out[h] = tiers
        return out

    def touch_host(self, hashes: Iterable[BlockHash]) -> None:
        """Mark host copies most-recently-used (OffloadingManager.touch; the LRU
        evicts least-recent first). Earlier hashes end up more recent, matching
        vLLM, which keeps prefix heads longest."""
        keys = [self.key(h, g) for h in hashes for g in self.group_ids
                if self.primary.lookup(self.key(h, g), self._probe) is LookupResult.HIT]
        self.primary.touch(keys, self._probe)

    def host_capacity(self) -> int:
        """Host-tier capacity in chunks (= blocks with blocks_per_chunk 1)."""
        return vllm_private.host_chunk_capacity(self.primary)

    def host_used(self) -> int:
        """Chunks holding data or reserved for an in-flight store."""
        return vllm_private.host_chunks_in_use(self.primary)

    def host_work_in_flight(self) -> bool:
        """Whether host chunks pinned now will be released by work already under way:
        stores not yet landed (ref_cnt -1), the tiering manager's file transfers, or
        KvHint's own injected stores. (A request's load pins chunks too, invisibly here.)"""
        return (bool(vllm_private.host_chunks_being_written(self.primary))
                or self.manager.has_pending_work() or bool(self._ops))

    def pending_file_writes(self) -> int:
        """Host -> file-tier cascade jobs still in flight (TieringOffloadingManager._jobs)."""
        return vllm_private.file_writes_in_flight(self.manager)

    def busy(self) -> bool:
        """True while an injected store or a prefetch needs the engine to keep stepping."""
        return bool(self._ops) or bool(self._prefetches)

    # -------------------------------------------------------------- Demote
    def demote_check(self, hashes: Iterable[BlockHash]) -> DemoteReport:
        rep = DemoteReport()
        for h in hashes:
            st = self.host_state(h)
            if st is HostState.READY:
                rep.ready.append(h)
            elif st is HostState.PENDING:
                rep.pending.append(h)
            elif self.g1_has(h):
                rep.missing.append(h)
            else:
                rep.lost.append(h)
        return rep

    def install(self) -> None:
        """Wrap three connector methods (instance attributes, idempotent) so injected
        store jobs reach the worker and their completions come back here."""
        if self._installed:
            return
        c = self.connector
        orig_build, orig_update = c.build_connector_meta, c.update_connector_output
        orig_pending, orig_take = c.has_pending_push_work, c.take_events

        def build_connector_meta(scheduler_output):
            meta = orig_build(scheduler_output)
            for jid, op in self._ops.items():
                if op._job is not None:
                    meta.store_jobs[jid] = op._job
                    op._job = None  # handed to the workers
            return meta

        def update_connector_output(connector_output):
            wm = connector_output.kv_connector_worker_meta
            if isinstance(wm, OffloadingWorkerMetadata):
                for jid in [j for j in wm.completed_jobs if j in self._ops]:
                    op = self._ops[jid]
                    op._pending_workers -= wm.completed_jobs.pop(jid)
                    if op._pending_workers <= 0:
                        self._finish_store(self._ops.pop(jid), success=True)
            return orig_update(connector_output)

        def has_pending_push_work():
            return orig_pending() or self.busy()

        def take_events():
            events = list(orig_take())
            for cb in self._event_taps:
                cb(events)
            return events

        c.build_connector_meta = build_connector_meta
        c.update_connector_output = update_connector_output
        c.has_pending_push_work = has_pending_push_work
        c.take_events = take_events
        self._installed = True

    def force_store(self, hashes: Iterable[BlockHash],
                    on_done: Callable[[StoreOp], None] | None = None,
                    keep: Iterable[BlockHash] = ()) -> StoreOp:
        """EXPERIMENTAL. Store G1 blocks that have no host copy, without a request.

        The G1 blocks are pinned (BlockPool.touch) until the copy completes, then
        released with BlockPool.free_blocks (they re-enter the free queue at the
        tail; `on_done` may move or evict them). Requires blocks_per_chunk == 1.

        `keep`: blocks whose host copies this store must not evict to make its room
        (an operation's copies made so far). Their landed keys go into the same
        `prepare_store` call, and vLLM never evicts a key of the call's own input
        (`cpu/manager.py`, "Chunks from the original input are excluded"): where the
        room can only come from them, the store fails "no evictable chunk" instead.
        """
        assert self.blocks_per_chunk == 1, "force_store needs blocks_per_chunk == 1"
        self.install()
        pool = self.scheduler.kv_cache_manager.block_pool
        op = StoreOp(op_id=f"kvhint-store-{next(_ids)}", hashes=[], skipped_ready=[], not_in_g1=[],
                     on_done=on_done)
        by_key: dict[OffloadKey, Any] = {}
        keys: list[OffloadKey] = []
        per_group: list[list[OffloadKey]] = [[] for _ in self.group_ids]
        for h in dict.fromkeys(hashes):
            # Every group's G1 copy that exists (a window group's only near a tail); the block
            # is in G1 when every required group has one (as `g1_has`).
            copies = {g: found[0] for g in self.group_ids if (found := pool.get_cached_block(h, [g])) is not None}
            if self.host_state(h) is not HostState.ABSENT:
                # The host holds (or is storing) the block: only the copies it lacks that G1
                # holds (on a hybrid model, window tails the host evicted or never took).
                copies = {g: b for g, b in copies.items()
                          if self.primary.lookup(self.key(h, g), self._probe) is LookupResult.MISS}
                if not copies:
                    op.skipped_ready.append(h)
                    continue
            elif not all(g in copies for g in self.required_group_ids):
                op.not_in_g1.append(h)
                continue
            op.hashes.append(h)
            for gi, g in enumerate(self.group_ids):
                if g in copies:
                    k = self.key(h, g)
                    by_key[k] = copies[g]
                    per_group[gi].append(k)
        keys = [k for grp in per_group for k in grp]  # group-major, as GPULoadStoreSpec expects
        if not keys:
            op.done = True
            return op
        stored = set(keys)
        kept = [k for k in self.host_keys(dict.fromkeys(keep)) if k not in stored]
        op._ctx = ReqContext(req_id=op.op_id)
        self.manager.on_new_request(op._ctx)
        try:
            self._inject_store(op, keys, kept, by_key, per_group)
        except BaseException:
            # Nothing of a store that could not be injected stays behind (chunks it evicted stay
            # evicted): finished failed, as an unsent one (host chunks freed, device blocks
            # unpinned, request context finished); the caller sees the error (vLLM's private
            # names it uses may change, README).
            self._ops.pop(op.job_id, None)
            op._job = None
            self._finish_store(op, success=False)
            raise
        return op

    def _inject_store(self, op: StoreOp, keys: list[OffloadKey], kept: list[OffloadKey],
                      by_key: dict[OffloadKey, Any], per_group: list[list[OffloadKey]]) -> None:
        """`force_store` after its request context exists: room on the host tier, the pins, the job."""
        ctx, pool = op._ctx, self.scheduler.kv_cache_manager.block_pool
        out = self.manager.prepare_store(keys + kept, ctx)
        if out is None:  # host tier full of in-use chunks
            self.manager.on_request_finished(ctx)
            op.failed, op.done = "host tier has no evictable chunk", True
            return
        op.evicted_keys = list(out.evicted_keys)
        to_store = set(out.keys_to_store)
        op._keys = [k for k in keys if k in to_store]
        if not op._keys:
            self.manager.on_request_finished(ctx)
            op.done = True
            return
        op._blocks = [by_key[k] for k in op._keys]
        pool.touch(op._blocks)  # pin: no reuse before the copy ran
        group_sizes = [len(to_store.intersection(grp)) for grp in per_group]
        src = GPULoadStoreSpec([b.block_id for b in op._blocks], group_sizes=group_sizes,
                               block_indices=[0] * len(group_sizes))
        op._job = TransferJob(req_id=op.op_id, src_spec=src, dst_spec=out.store_spec)
        op.job_id = self.cs._generate_job_id()  # shared counter: never collides with the connector's jobs
        op._pending_workers = self.cs.config.num_workers
        self._ops[op.job_id] = op

    def drop_in_flight_stores(self) -> None:
        """After the connector's cache was reset (reset_prefix_cache with reset_connector):
        the stores still in flight were prepared on the manager before the reset. vLLM drops
        its own such jobs (`_stale_job_threshold`); these complete only to unpin their device
        blocks, never against the reset manager (whose chunks for the same keys, if any, are a
        later request's, still being written; with a file tier, completing them would cascade
        chunks the reset manager does not hold and fail the engine step).

        A store whose job has not gone to the workers yet (force_store ran between steps, e.g. a
        Demote started from EngineCore's idle loop) is dropped here: handed over after the reset,
        its copy would write host chunks the reset manager hands out again, after the stores of
        the same step (KvHint's jobs follow vLLM's in the metadata), overwriting another block's
        host copy. vLLM itself has no such job at a reset."""
        for job_id, op in list(self._ops.items()):
            op._stale = True
            self._drop_if_unsent(job_id, op)

    def release_device_holds(self, reason: str) -> list[StoreOp]:
        """Engine thread, just before vLLM resets the device prefix cache with its running requests
        preempted (`Scheduler.reset_prefix_cache(reset_running_requests=True)`: EngineCore's
        cache reset at pause and sleep), which fails while any device block is in use: every
        store in flight gives its device blocks back now (`BlockPool.free_blocks`) and fails with
        `reason`. A store whose job has not gone to the workers is dropped at once; one the
        workers run completes later, unpinning nothing and dropping its host chunks (the
        device blocks may be reused before the copy runs). Returns the stores released."""
        pool = self.scheduler.kv_cache_manager.block_pool
        released = []
        for job_id, op in list(self._ops.items()):
            if not op._blocks:
                continue
            blocks, op._blocks = op._blocks, []
            pool.free_blocks(blocks)
            op.failed = op.failed or reason
            released.append(op)
            self._drop_if_unsent(job_id, op)
        return released

    def cancel_store(self, op: StoreOp) -> None:
        """Drop an injected store whose job has not gone to the workers (its operation was
        abandoned): host chunks freed, device blocks unpinned now. One the workers run completes."""
        if op.job_id is not None and self._ops.get(op.job_id) is op:
            self._drop_if_unsent(op.job_id, op)

    def _drop_if_unsent(self, job_id: int, op: StoreOp) -> None:
        """A store whose job has not gone to the workers gets no completion: finish it now, failed."""
        if op._job is not None:
            op._job = None
            self._finish_store(self._ops.pop(job_id), success=False)

    def _finish_store(self, op: StoreOp, success: bool) -> None:
        if op._stale:
            success = False
            op.failed = op.failed or "the KV connector cache was reset during the copy"
        else:
            # A store released at a device reset (`release_device_holds`, op.failed set) keeps no copy.
            success = success and op.failed is None
            self.manager.complete_store(op._keys, op._ctx, success)  # tiering: cascades to file tiers here
        self.manager.on_request_finished(op._ctx)
        self.scheduler.kv_cache_manager.block_pool.free_blocks(op._blocks)  # none once released
        op._blocks = []
        op.done = True
        if op.on_done is not None:
            op.on_done(op)

    # -------------------------------------------------------------- events
    def tap_events(self, callback: Callable[[list], None]) -> None:
        """`callback(events)` sees every batch of connector KV events (vllm.distributed.
        kv_events.BlockStored / BlockRemoved, medium "CPU" / "STORAGE") before vLLM's
        publisher does. Needs kv_events_config.enable_kv_cache_events (publisher "null" is fine)."""
        self.install()
        self._event_taps.append(callback)


class Prefetch:
    """Warm the host tier from the file tier (or any secondary tier) without a request.

    Uses the connector's own per-request path with a synthetic ReqContext:
    `on_new_request`, then `lookup` on every `poll()` (RETRY while the async file
    probe runs, HIT_PENDING once the promotion is submitted, HIT when it is in host
    memory); promotions are submitted from the manager's `on_schedule_end`, which
    the connector calls every scheduler step. Call `poll()` once per step; it
    closes itself (`on_request_finished`) when every key is HIT or MISS.
    """

    def __init__(self, ctl: TierControl, hashes: Iterable[BlockHash]):
        self.ctl = ctl
        self.ctx = ReqContext(req_id=f"kvhint-prefetch-{next(_ids)}")
        self.keys = {ctl.key(h, g): h for h in dict.fromkeys(hashes) for g in ctl.group_ids}
        self._required = {ctl.key(h, g) for h in dict.fromkeys(hashes) for g in ctl.required_group_ids}
        self.state: dict[OffloadKey, LookupResult] = {}
        self._first: dict[OffloadKey, LookupResult] = {}  # each key's first answer
        self.polls = 0
        self.closed = False
        ctl.install()
        ctl.manager.on_new_request(self.ctx)
        ctl._prefetches.add(self)
        try:
            self.poll()
        except BaseException:
            self.close()  # no one holds a Prefetch whose first round raised: it must not keep the engine stepping
            raise

    def poll(self) -> bool:
        """Advance; returns True when finished (all keys HIT or MISS)."""
        if self.closed:
            return True
        self.polls += 1
        for k in self.keys:
            if self.state.get(k) not in (LookupResult.HIT, LookupResult.MISS):
                self.state[k] = self.ctl.manager.lookup(k, self.ctx)
                self._first.setdefault(k, self.state[k])
        if all(s in (LookupResult.HIT, LookupResult.MISS) for s in self.state.values()):
            self.close()
        return self.closed

    @property
    def promoted_copies(self) -> int:
        """Copies the host tier holds now that it did not hold at the first lookup."""
        return sum(1 for k, st in self.state.items() if st is LookupResult.HIT and self._first.get(k) is not LookupResult.HIT)

    @property
    def promoted_blocks(self) -> set[BlockHash]:
        """Blocks a copy of which the host tier holds now and did not at the first lookup (on a
        hybrid model also a block whose full-attention copy was there and whose window copy came)."""
        return {h for k, h in self.keys.items()
                if self.state.get(k) is LookupResult.HIT and self._first.get(k) is not LookupResult.HIT}

    @property
    def hits(self) -> list[BlockHash]:
        """Blocks whose every required-group copy is now on the host tier."""
        missed = set(self.misses)
        return list(dict.fromkeys(h for k, h in self.keys.items()
                                  if k in self._required and self.state.get(k) is LookupResult.HIT and h not in missed))

    @property
    def misses(self) -> list[BlockHash]:
        """Blocks a required-group copy of which the file tier did not have (a window copy
        it lacks is not a miss: window groups keep tails only)."""
        return list(dict.fromkeys(h for k, h in self.keys.items()
                                  if k in self._required and self.state.get(k) is LookupResult.MISS))

    def close(self) -> None:
        if not self.closed:
            self.ctl.manager.on_request_finished(self.ctx)
            self.ctl._prefetches.discard(self)
            self.closed = True
