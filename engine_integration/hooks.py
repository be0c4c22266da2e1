"""Hooks into vLLM's BlockPool and KVCacheManager.

KvHint's pool and manager are subclasses of vLLM's, built by vLLM itself:
`hooked_construction()` is the window (KvHintScheduler's `super().__init__`)
in which vLLM's Scheduler constructs `KvHintKVCacheManager`, whose coordinator
constructs `KvHintBlockPool`. `install(scheduler, adapter)` then connects them
to the adapter. They are built as these classes rather than re-classed after
the fact: CPython (3.11 and 3.12) turns an instance's attribute storage into
a plain dict when its `__class__` is assigned, and every `self.<attribute>`
in vLLM's pool and manager code is slower from then on (about 4.5 points of
scheduler CPU at 16k blocks, bench/results/scale_ablation_repeat.md;
design-notes.md, "Hooks into vLLM 0.32"). The subclasses call the stock
methods and add:

  * admission: every `cache_full_blocks`, of every KV-cache group, is
    reported with the owning request (so the index and the event stream see
    it with its session);
  * prefix hits: the local lookup (`get_computed_blocks`, and
    `get_computed_blocks_for_connector` with a connector) is only noted; the
    hit is booked when the request takes the blocks (a hit establishes
    membership): at its first `cache_full_blocks` in the admission's
    `allocate_slots`, or else at `record_prefix_cache_stats`, which vLLM's
    scheduler calls once per admitted request with the local hit it used.
    vLLM looks a waiting request up again every step it cannot admit it
    (allocate_slots returns None under memory pressure), so a hit booked at
    the lookup would join sessions to blocks they never used and refresh
    the index every step;
  * removal: `_emit_block_removed_events` reports each logical block that
    stops being resident (its last copy in a residency group is gone; see
    kv_groups), with a cause (eviction, Evict hint, pin broken, replaced);
    `get_new_blocks` reports an allocation's removals in one call after it
    (unless a pin is being broken it runs vLLM's own allocation with vLLM's
    eviction step written into its loop: one Python frame fewer per block;
    unless a removed block holds a grant, whose report must end it at once,
    it adds the removed keys to the adapter's carry, reported together before
    the step's next store or report and at the step boundary:
    VllmAdapter.flush_removed);
  * retention order: free blocks that a hint protects are kept out of the free
    queue (`ProtectedFreeBlocks`) and counted as free; the queue (ordinary,
    LRU) is consumed first, then retained blocks by priority, then pins.

Two of these paths repeat vLLM 0.32.0's own statements for speed: the allocation's loop, and the
free hook's walk back from the free queue's tail to the blocks vLLM just freed. `install` runs
each only when the installed vLLM's methods are those statements (vllm_compat.check, once per
process); otherwise it calls vLLM's own `get_new_blocks` (removals reported per allocation) or
looks at the freed blocks themselves, and logs why. A prefix-cache reset repeats no vLLM
condition: the protected blocks go back to the queue, and are filed again if vLLM refuses.

The retention order is switched by a flag, `_kvh_retaining`: on while a free
block is protected, a pin is being broken or a retention grant is in effect,
and off otherwise (`kvh_sync_mode`, on the engine thread: after every
re-filing, and at each step boundary). With it off, `get_num_free_blocks`,
`_maybe_evict_cached_block`, `touch` and `free_blocks` go straight to vLLM's
own code and `get_new_blocks` runs vLLM's statements, so the eviction order
and allocation results are exactly stock vLLM's
(tests/inproc/test_pool_hooks_stock.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

import vllm.v1.core.kv_cache_coordinator as _coordinator_module
import vllm.v1.core.sched.scheduler as _scheduler_module
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager

from kvhint_server.model import RemovalCause, RetentionClass, RetentionView

from . import vllm_compat, vllm_private
from .protected import ProtectedFreeBlocks

if TYPE_CHECKING:
    from .adapter import VllmAdapter


log = logging.getLogger("kvhint.vllm")

# Stock methods the hot overrides call directly (cheaper than super() on every block).
_emit_removed = BlockPool._emit_block_removed_events
_maybe_evict = BlockPool._maybe_evict_cached_block
_get_new_blocks = BlockPool.get_new_blocks
_free_blocks = BlockPool.free_blocks
_touch = BlockPool.touch
_cache_full_blocks = BlockPool.cache_full_blocks
_get_computed_blocks = KVCacheManager.get_computed_blocks
_get_computed_blocks_for_connector = KVCacheManager.get_computed_blocks_for_connector
_record_prefix_cache_stats = KVCacheManager.record_prefix_cache_stats
_free_request = KVCacheManager.free


class KvHintBlockPool(BlockPool):
    """vLLM's BlockPool with KvHint's residency reports and retention order (module doc)."""

    _kvh: VllmAdapter

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Every attribute exists from construction (the instance keeps CPython's compact
        # attribute storage; see the module doc); `_kvh_init` gives them their values.
        self._kvh = None  # type: ignore[assignment]
        self._kvh_protected = ProtectedFreeBlocks()
        self._kvh_cause = RemovalCause.EVICTED
        self._kvh_pending: list[Any] | None = None
        self._kvh_runs: list[tuple[int, RemovalCause]] = []
        self._kvh_broken: set[int] = set()
        # Logical blocks whose pins broke in this allocation's reclaim: their other copies are
        # unprotected after it, so that they do not go ahead of ordinary blocks in it.
        self._kvh_unprotect: list[bytes] = []
        self._kvh_retaining = False  # the retention order is on (module doc)
        # While KvHintKVCacheManager.free runs with the retention order on: the freed cached
        # blocks of every group, refiled together after it (VllmAdapter.refile_freed).
        self._kvh_freed: list[tuple[Any, Any]] | None = None
        # vLLM's lazy CPU offloaders walking this pool's free queue (watch_lazy_offloaders).
        self._kvh_lazy: tuple[Any, ...] = ()
        # KV-cache group ids whose copies KvHint does not book (a sliding-window tail beside full
        # attention; VllmAdapter.attach_pool sets them): cache_full_blocks is vLLM's own for them.
        self._kvh_unbooked: frozenset[int] = frozenset()
        # The adapter's carry (VllmAdapter.flush_removed): the allocation fast path adds the keys
        # it removes here instead of reporting each allocation's; None: reported per allocation
        # (no adapter yet, or lower tiers attached).
        self._kvh_carry: list[Any] | None = None
        # The fast paths that repeat vLLM 0.32's statements, on unless `install` finds the
        # installed vLLM's methods differ (vllm_compat): the allocation's (get_new_blocks) and
        # the free hook's walk back from the free queue's tail.
        self._kvh_fast_alloc = True
        self._kvh_tail_walk = True

    def _kvh_init(self, adapter: VllmAdapter) -> None:
        self._kvh = adapter
        self._kvh_protected = ProtectedFreeBlocks(adapter.core.monotonic)

    # ------------------------------------------------------------ admission / removal

    def cache_full_blocks(self, request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id, block_mask=None):  # type: ignore[no-untyped-def]
        if num_cached_blocks >= num_full_blocks:
            return
        if self._kvh_carry:  # removals before this store are reported before it (the order vLLM made them)
            self._kvh.flush_removed()
        if kv_cache_group_id in self._kvh_unbooked:
            # Nothing to report: on_blocks_cached books no copy of such a group, and
            # on_keys_removed drops its keys whatever their cause.
            _cache_full_blocks(self, request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id, block_mask)
            return
        self._kvh_cause = RemovalCause.REPLACED
        try:
            _cache_full_blocks(self, request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id, block_mask)
        finally:
            self._kvh_cause = RemovalCause.EVICTED
        self._kvh.on_blocks_cached(request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id, block_mask)

    def _emit_block_removed_events(self, block_hashes):  # type: ignore[no-untyped-def]
        if self.enable_kv_cache_events:  # stock returns at once without it (one call per evicted block)
            _emit_removed(self, block_hashes)
        pending = self._kvh_pending
        if pending is None:
            self._kvh.on_keys_removed(block_hashes, self._kvh_cause)
            return
        # Inside get_new_blocks: buffer the keys flat, noting where a run of another cause
        # (a broken pin's blocks) starts.
        runs, cause = self._kvh_runs, self._kvh_cause
        if not runs or runs[-1][1] is not cause:
            runs.append((len(pending), cause))
        pending.extend(block_hashes)

    def _maybe_evict_cached_block(self, block):  # type: ignore[no-untyped-def]
        if not self._kvh_retaining:
            return _maybe_evict(self, block)
        protected = self._kvh_protected
        # Inside get_new_blocks (pending is a list) the block came off the free queue, which
        # holds no protected block: only other callers (connector invalidation) need the check.
        if protected.count and self._kvh_pending is None and protected.remove(block):
            # A protected free block losing its hash (connector invalidation):
            # it is an ordinary free block again.
            self.free_block_queue.prepend_n([block])
        broken = self._kvh_broken
        if broken and block.block_id in broken:
            broken.discard(block.block_id)
            previous, self._kvh_cause = self._kvh_cause, RemovalCause.PIN_BROKEN
            try:
                return _maybe_evict(self, block)
            finally:
                self._kvh_cause = previous
        return _maybe_evict(self, block)

    def reset_prefix_cache(self) -> bool:
        # vLLM's reset needs every block but the null block free, and then drops every block's
        # hash. Protected blocks are free but out of its queue: they go back into it first, so
        # the reset finds them free and leaves them ordinary (hashless) free blocks, whatever
        # condition the installed vLLM checks; if it refuses, they are filed again as they were,
        # in the order they were in.
        protected = self._kvh_protected
        filings = [(block, protected.filed_as(block)) for block in protected.blocks()] if protected.count else []
        if filings:
            for block, _ in filings:
                protected.remove(block)
            self.free_block_queue.append_n([block for block, _ in filings])
        ok = super().reset_prefix_cache()
        if ok:
            self._kvh.on_device_cleared()
            self.kvh_sync_mode()  # nothing protected and no grant left: the retention order is off
        elif filings:
            for block, (cls, priority, reuse_at) in filings:
                self._kvh_unqueue(block)
                protected.add(block, cls, priority, reuse_at)
        return ok

    # ------------------------------------------------------------ allocation

    def get_num_free_blocks(self) -> int:
        # Protected free blocks count as free (with nothing protected, count is 0: stock).
        return self.free_block_queue.num_free_blocks + self._kvh_protected.count

    def get_new_blocks(self, num_blocks: int):  # type: ignore[no-untyped-def]
        retaining = self._kvh_retaining
        if retaining:
            if self._kvh_protected.count:
                self._kvh.core.expire_retention()  # may turn the retention order off
                shortfall = num_blocks - self.free_block_queue.num_free_blocks
                if shortfall > 0:
                    self._kvh_reclaim(shortfall)
            retaining = self._kvh_retaining
        if (retaining and self._kvh_broken) or not self._kvh_fast_alloc:
            # A pin is being broken, or the installed vLLM's allocation is not the one the fast
            # path below repeats (vllm_compat): vLLM's own allocation, which calls
            # `_maybe_evict_cached_block` per block, so that the broken pin's blocks are
            # evicted with their own cause; the removals inside it are reported together
            # after it (one journal entry per run of the same cause).
            self._kvh_pending = pending = []
            self._kvh_runs = runs = []
            try:
                return _get_new_blocks(self, num_blocks)
            finally:
                self._kvh_pending = None
                if pending:
                    if len(runs) == 1:  # one cause (the usual case)
                        self._kvh.on_keys_removed(pending, runs[0][1])
                    else:
                        self._kvh_flush_removed(pending, runs)
                if self._kvh_unprotect:  # copies of blocks whose pins broke (_kvh_reclaim)
                    digests, self._kvh_unprotect = self._kvh_unprotect, []
                    self._kvh.unprotect_copies(digests)
        # No pin is being broken, and vLLM's allocation is 0.32's (the retention order on or off;
        # with it on, the queue holds no protected block, so vLLM's eviction step is all the
        # per-block work): vLLM 0.32's own get_new_blocks with its eviction step, vLLM's
        # _maybe_evict_cached_block, written into the loop, and the removed keys of the whole
        # allocation carried to the step's next report
        # (VllmAdapter.flush_removed), or reported in one call after it when one of them holds a
        # grant (the report ends the removed blocks' grants, which the rest of the step must see)
        # or without a carry. That is one Python frame fewer per block taken than
        # vLLM's own loop (two with the retention order on), and a hybrid model takes a copy per
        # group. `install` compares both vLLM methods with the statements repeated here
        # (vllm_compat.check, AST) and tests/inproc/test_pool_hooks_stock.py the results with
        # stock vLLM's (Hypothesis).
        if not self.enable_caching:  # nothing to evict (KvHintScheduler refuses such an engine)
            return _get_new_blocks(self, num_blocks)
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        ret = self.free_block_queue.popleft_n(num_blocks)
        if self._reuse_watchers:
            self._notify_reuse(ret)
        # The cause here is always EVICTED: the other causes are set only around vLLM calls that
        # do not allocate, and a broken pin's blocks take the path above.
        carry = self._kvh_carry
        removed: list[Any] = carry if carry is not None and not retaining else []
        metrics = self.metrics_collector
        remove_hashes = self._remove_cached_block_hashes
        events = self.enable_kv_cache_events
        try:
            for block in ret:
                if metrics:
                    metrics.on_block_evicted(block)
                evicted = remove_hashes(block)
                if evicted:
                    if events:
                        _emit_removed(self, evicted)
                    removed += evicted
                assert block.ref_cnt == 0
                block.ref_cnt += 1
                if metrics:
                    metrics.on_block_allocated(block)
        finally:
            if removed and removed is not carry:
                if carry is not None and not self._kvh.granted_keys(removed):
                    carry += removed  # no grant to end now: reported with the step's other removals
                else:
                    self._kvh.on_keys_removed(removed, self._kvh_cause)
        return ret

    def _kvh_flush_removed(self, pending: list[Any], runs: list[tuple[int, RemovalCause]]) -> None:
        """Report buffered removals: `runs` holds (start in `pending`, cause) per run."""
        ends = [start for start, _ in runs[1:]] + [len(pending)]
        for (start, cause), end in zip(runs, ends):
            self._kvh.on_keys_removed(pending[start:end], cause)

    def _kvh_reclaim(self, shortfall: int) -> None:
        """Move `shortfall` protected blocks to the queue head, in class order."""
        retained, pinned = self._kvh_protected.take_victims(shortfall)
        if pinned:
            self._kvh_broken.update(b.block_id for b in pinned)
            self._kvh_unprotect += self._kvh.on_pins_broken(pinned, shortfall)
        victims = retained + pinned
        if victims:
            self.free_block_queue.prepend_n(victims)

    def touch(self, blocks) -> None:  # type: ignore[no-untyped-def]
        if self._kvh_retaining:
            protected = self._kvh_protected
            filed = protected.filed
            if filed:
                # Only free blocks can be filed, and most touched blocks are in use (a shared
                # prefix): the slot reads come first (cheaper than an attrgetter scan in C).
                for block in blocks:
                    if not block.ref_cnt and block.block_id in filed and protected.remove(block):
                        # Back in the queue so the stock touch can take it out.
                        self.free_block_queue.append(block)
        _touch(self, blocks)

    def free_blocks(self, ordered_blocks: Iterable[Any]) -> None:
        if not self._kvh_retaining or not self._kvh.retention_active():
            _free_blocks(self, ordered_blocks)
            return
        if self._kvh_tail_walk:  # vLLM 0.32's free_blocks: the freed cached blocks are at the queue's tail
            mark = vllm_private.queue_tail(self)
            _free_blocks(self, ordered_blocks)
            freed = self._kvh.granted_since(mark)
        else:  # another vLLM's (vllm_compat): look at the blocks themselves
            blocks = list(ordered_blocks)
            _free_blocks(self, blocks)
            freed = self._kvh.granted_among(blocks)
        if self._kvh_freed is not None:  # one request's groups, one after the other: filed together
            self._kvh_freed += freed
        else:
            self._kvh.refile_freed(freed)

    # ------------------------------------------------------------ used by the adapter

    def kvh_refile_block(self, block: Any, view: RetentionView | None = None, refresh: bool = False) -> None:
        """File one free cached block by its current retention class (`view`,
        when the caller already has it). `refresh`: a block already filed so is filed
        again, as the most recent of its bucket (the order a hint or a free sets)."""
        if block.ref_cnt != 0 or block.is_null:
            return
        protected = self._kvh_protected
        if view is None:
            view = self._kvh.retention_of_block(block)
        filed = protected.filed_as(block)
        if view.cls is RetentionClass.ORDINARY:
            if filed is not None:
                protected.remove(block)
                self.free_block_queue.prepend_n([block])
            return
        if filed == (view.cls, view.priority, view.reuse_at) and not refresh:
            return
        if filed is None:
            self._kvh_unqueue(block)
        protected.add(block, view.cls, view.priority, view.reuse_at)
        self._kvh_retaining = True  # something is protected now

    def kvh_to_queue_head(self, block: Any) -> None:
        """Make a free block the next eviction candidate."""
        if block.ref_cnt != 0 or block.is_null:
            return
        if not self._kvh_protected.remove(block):
            self._kvh_unqueue(block)
        self.free_block_queue.prepend_n([block])

    def _kvh_unqueue(self, block: Any) -> None:
        """Take a free block out of vLLM's free queue (to protect it, or to move it); a lazy
        offloader's cursor must not stay on a block out of the queue."""
        if self._kvh_lazy:
            vllm_private.move_lazy_cursors_off(self._kvh_lazy, block, self.free_block_queue)
        self.free_block_queue.remove(block)

    def kvh_evict(self, block: Any, cause: RemovalCause) -> bool:
        """Drop a free block's hash now and put it at the queue head."""
        if block.ref_cnt != 0 or block.is_null:
            return False
        self.kvh_to_queue_head(block)
        previous, self._kvh_cause = self._kvh_cause, cause
        try:
            return _maybe_evict(self, block)
        finally:
            self._kvh_cause = previous

    def kvh_sync_mode(self) -> None:
        """Engine thread: the retention order is on while a free block is protected, a pin is
        being broken or a retention grant is in effect, and off otherwise. Called after every
        re-filing (grants, releases, expiry) and at each step boundary; `kvh_refile_block`
        turns it on itself when it protects a block."""
        self._kvh_retaining = bool(self._kvh_protected.count or self._kvh_broken or self._kvh.retention_active())

    @property
    def kvh_retaining(self) -> bool:
        """The retention order is on (tests and diagnostics)."""
        return self._kvh_retaining


class KvHintKVCacheManager(KVCacheManager):
    """vLLM's KVCacheManager whose coordinator builds a KvHintBlockPool (module doc)."""

    _kvh: VllmAdapter

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # KVCacheManager.__init__ builds exactly one coordinator, which builds the device pool.
        with _rebound(_coordinator_module, "BlockPool", KvHintBlockPool):
            super().__init__(*args, **kwargs)
        self._kvh = None  # type: ignore[assignment]

    def get_computed_blocks(self, request):  # type: ignore[no-untyped-def]
        # Called when a waiting request is considered for admission (not per decode step),
        # again every step in which it cannot be admitted: the hit is noted, not booked. The
        # adapter books it when the request takes the blocks (module doc, "prefix hits").
        result = _get_computed_blocks(self, request)
        self._kvh.pending_hit = (request, result[1]) if result[1] else None
        return result

    def get_computed_blocks_for_connector(self, request):  # type: ignore[no-untyped-def]
        # The local lookup with a connector that supports divergent hybrid hits (vLLM's
        # scheduler calls this one instead of get_computed_blocks then); noted as that one.
        result = _get_computed_blocks_for_connector(self, request)
        self._kvh.pending_hit = (request, result[1]) if result[1] else None
        return result

    def free(self, request):  # type: ignore[no-untyped-def]
        # vLLM frees a finished request's blocks group by group (one free_blocks call each);
        # with the retention order on, the copies freed are filed together after the last
        # group's, by logical block (VllmAdapter.refile_freed). Once per finished request.
        pool = self.block_pool
        if not pool._kvh_retaining:
            return _free_request(self, request)
        pool._kvh_freed = freed = []
        try:
            return _free_request(self, request)
        finally:
            pool._kvh_freed = None
            if freed:
                self._kvh.refile_freed(freed)

    def record_prefix_cache_stats(self, request, num_hits):  # type: ignore[no-untyped-def]
        # vLLM's scheduler calls this once per admitted request that looked the cache up
        # ("Record at admission so unscheduled lookups are not counted"), with the local hit
        # tokens the request took. The hit is booked here unless the admission's first
        # cache_full_blocks booked it already (VllmAdapter.on_blocks_cached).
        if self._kvh.pending_hit is not None:
            self._kvh.on_lookup_taken(request, num_hits)
        _record_prefix_cache_stats(self, request, num_hits)


@contextmanager
def _rebound(module: Any, name: str, value: Any) -> Iterator[None]:
    """`module.name` is `value` inside the block, its own value again after it (also on error)."""
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def hooked_construction() -> AbstractContextManager[None]:
    """Inside the block, vLLM's Scheduler builds `KvHintKVCacheManager` (and through it a
    `KvHintBlockPool`) where it would build its own KVCacheManager. Engine thread, around the
    Scheduler's `__init__` only: it rebinds module globals of vLLM's scheduler and coordinator
    modules for that long (construction is single-threaded in EngineCore)."""
    return _rebound(_scheduler_module, "KVCacheManager", KvHintKVCacheManager)


def watch_lazy_offloaders(pool: KvHintBlockPool, connector: Any) -> tuple[Any, ...]:
    """Engine thread, at construction: the lazy CPU offloaders in `connector` bound to `pool`
    (vLLM's SimpleCPUOffloadConnector with `lazy_offload`; vllm_private.lazy_offloaders). Their
    walk keeps a cursor into the free queue, and vLLM assumes a block leaves the queue only by
    gaining a reference; KvHint's retention order takes protected free blocks out of it with
    none, so the pool moves such a cursor off the block first (kvh_refile_block,
    kvh_to_queue_head: only while blocks are filed or moved by hints, never per block on the
    path without hints). Returns them."""
    pool._kvh_lazy = vllm_private.lazy_offloaders(connector, pool) if connector is not None else ()
    return pool._kvh_lazy


def install(scheduler: Any, adapter: VllmAdapter) -> KvHintBlockPool:
    """Connect the scheduler's hooked KV cache manager and block pool (built inside
    `hooked_construction`, or directly as KvHintKVCacheManager) to `adapter`."""
    manager = scheduler.kv_cache_manager
    if type(manager) is not KvHintKVCacheManager or type(manager.block_pool) is not KvHintBlockPool:
        raise RuntimeError(
            "kvhint expects the scheduler's KVCacheManager/BlockPool to be built as KvHintKVCacheManager/"
            f"KvHintBlockPool (engine_integration.hooks.hooked_construction), got {type(manager).__name__}/"
            f"{type(manager.block_pool).__name__}: this vLLM builds them differently from vLLM 0.32"
        )
    pool = manager.block_pool
    pool._kvh_init(adapter)
    manager._kvh = adapter
    # The fast paths that repeat vLLM 0.32's statements run only on a vLLM whose methods are those
    # statements (vllm_compat: checked once per process).
    compat = vllm_compat.check()
    pool._kvh_fast_alloc, pool._kvh_tail_walk = compat.fast_allocation, compat.free_tail_walk
    for warning in compat.warnings:
        log.warning("kvhint: %s", warning)
    watch_lazy_offloaders(pool, getattr(scheduler, "connector", None))
    return pool
