"""Hooks into vLLM's BlockPool and KVCacheManager.

`install(scheduler, adapter)` swaps the classes of the scheduler's existing
KVCacheManager and BlockPool to the subclasses below (vLLM builds them inside
the Scheduler, so a class swap is the least invasive hook). The subclasses
call the stock methods and add:

  * admission: every `cache_full_blocks`, of every KV-cache group, is
    reported with the owning request (so the index and the event stream see
    it with its session);
  * prefix hits: `allocate_slots` reports the hit blocks of requests with
    session coordinates (a hit establishes membership);
  * removal: `_emit_block_removed_events` reports each logical block that
    stops being resident (its last copy in a residency group is gone; see
    kv_groups), with a cause (eviction, Evict hint, pin broken, replaced);
  * retention order: free blocks that a hint protects are kept out of the free
    queue (`ProtectedFreeBlocks`) and counted as free; the queue (ordinary,
    LRU) is consumed first, then retained blocks by priority, then pins.

Two classes share this: `KvHintBlockPool` adds only the admission and removal
reports, and `KvHintRetainingBlockPool` adds the retention order on top. The
pool is the retaining class while a free block is protected, a pin is being
broken or a retention grant is in effect, and the plain class otherwise
(`kvh_sync_mode`, on the engine thread: after every re-filing, and at each
step boundary). So with no hints in effect `get_num_free_blocks`,
`_maybe_evict_cached_block`, `touch` and `free_blocks` are vLLM's own, and the
eviction order and allocation results are exactly stock vLLM's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager

from kvhint_server.model import RemovalCause, RetentionClass, RetentionView

from .protected import ProtectedFreeBlocks

if TYPE_CHECKING:
    from .adapter import VllmAdapter


# Stock methods the hot overrides call directly (cheaper than super() on every block).
_emit_removed = BlockPool._emit_block_removed_events
_maybe_evict = BlockPool._maybe_evict_cached_block
_get_new_blocks = BlockPool.get_new_blocks
_free_blocks = BlockPool.free_blocks


class KvHintBlockPool(BlockPool):
    _kvh: VllmAdapter
    _kvh_protected: ProtectedFreeBlocks
    _kvh_cause: RemovalCause
    _kvh_pending: list[Any] | None
    _kvh_runs: list[tuple[int, RemovalCause]]
    _kvh_broken: set[int]

    def _kvh_init(self, adapter: VllmAdapter) -> None:
        self._kvh = adapter
        self._kvh_protected = ProtectedFreeBlocks(adapter.core.monotonic)
        self._kvh_cause = RemovalCause.EVICTED
        self._kvh_pending = None
        self._kvh_runs = []
        self._kvh_broken = set()

    # ------------------------------------------------------------ admission / removal

    def cache_full_blocks(self, request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id, block_mask=None):  # type: ignore[no-untyped-def]
        if num_cached_blocks >= num_full_blocks:
            return
        self._kvh_cause = RemovalCause.REPLACED
        try:
            super().cache_full_blocks(
                request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id, block_mask
            )
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

    def reset_prefix_cache(self) -> bool:
        protected = self._kvh_protected
        if protected.count and self.num_gpu_blocks - self.get_num_free_blocks() == 1:
            blocks = protected.blocks()
            for block in blocks:
                protected.remove(block)
            self.free_block_queue.append_n(blocks)
        ok = super().reset_prefix_cache()
        if ok:
            self._kvh.on_device_cleared()
        return ok

    # ------------------------------------------------------------ allocation

    def get_new_blocks(self, num_blocks: int):  # type: ignore[no-untyped-def]
        # Removals inside one allocation are reported together (one journal entry per run of
        # the same cause), after it.
        self._kvh_pending = pending = []
        self._kvh_runs = runs = []
        try:
            return _get_new_blocks(self, num_blocks)
        finally:
            self._kvh_pending = None
            if pending:
                self._kvh_flush_removed(pending, runs)

    def _kvh_flush_removed(self, pending: list[Any], runs: list[tuple[int, RemovalCause]]) -> None:
        """Report buffered removals: `runs` holds (start in `pending`, cause) per run."""
        if len(runs) == 1:
            self._kvh.on_keys_removed(pending, runs[0][1])
            return
        ends = [start for start, _ in runs[1:]] + [len(pending)]
        for (start, cause), end in zip(runs, ends):
            self._kvh.on_keys_removed(pending[start:end], cause)

    # ------------------------------------------------------------ used by the adapter

    def kvh_refile_block(self, block: Any, view: RetentionView | None = None) -> None:
        """File one free cached block by its current retention class (`view`,
        when the caller already has it)."""
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
        if filed == (view.cls, view.priority, view.reuse_at):
            return
        if filed is None:
            self.free_block_queue.remove(block)
        protected.add(block, view.cls, view.priority, view.reuse_at)
        if self.__class__ is KvHintBlockPool:
            self.__class__ = KvHintRetainingBlockPool  # something is protected now

    def kvh_to_queue_head(self, block: Any) -> None:
        """Make a free block the next eviction candidate."""
        if block.ref_cnt != 0 or block.is_null:
            return
        if not self._kvh_protected.remove(block):
            self.free_block_queue.remove(block)
        self.free_block_queue.prepend_n([block])

    def kvh_evict(self, block: Any, cause: RemovalCause) -> bool:
        """Drop a free block's hash now and put it at the queue head."""
        if block.ref_cnt != 0 or block.is_null:
            return False
        self.kvh_to_queue_head(block)
        previous, self._kvh_cause = self._kvh_cause, cause
        try:
            return super()._maybe_evict_cached_block(block)
        finally:
            self._kvh_cause = previous

    def kvh_sync_mode(self) -> None:
        """Engine thread: the retaining class while a free block is protected, a pin is being
        broken or a retention grant is in effect; this class otherwise. Called after every
        re-filing (grants, releases, expiry) and at each step boundary; `kvh_refile_block`
        switches to the retaining class itself when it protects a block."""
        active = self._kvh_protected.count or self._kvh_broken or self._kvh.retention_active()
        cls = KvHintRetainingBlockPool if active else KvHintBlockPool
        if self.__class__ is not cls:
            self.__class__ = cls


class KvHintRetainingBlockPool(KvHintBlockPool):
    """The pool while retention is in effect: protected free blocks are kept out of vLLM's free
    queue, counted as free, and reclaimed in class order when the queue runs dry."""

    def _maybe_evict_cached_block(self, block):  # type: ignore[no-untyped-def]
        protected = self._kvh_protected
        if protected.count and protected.remove(block):
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

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks + self._kvh_protected.count

    def get_new_blocks(self, num_blocks: int):  # type: ignore[no-untyped-def]
        if self._kvh_protected.count:
            self._kvh.core.expire_retention()
            shortfall = num_blocks - self.free_block_queue.num_free_blocks
            if shortfall > 0:
                self._kvh_reclaim(shortfall)
        return KvHintBlockPool.get_new_blocks(self, num_blocks)

    def _kvh_reclaim(self, shortfall: int) -> None:
        """Move `shortfall` protected blocks to the queue head, in class order."""
        retained, pinned = self._kvh_protected.take_victims(shortfall)
        if pinned:
            self._kvh_broken.update(b.block_id for b in pinned)
            self._kvh.on_pins_broken(pinned, shortfall)
        victims = retained + pinned
        if victims:
            self.free_block_queue.prepend_n(victims)

    def touch(self, blocks) -> None:  # type: ignore[no-untyped-def]
        protected = self._kvh_protected
        if protected.count:
            for block in blocks:
                if block.ref_cnt == 0 and protected.remove(block):
                    # Back in the queue so the stock touch can take it out.
                    self.free_block_queue.append(block)
        super().touch(blocks)

    def free_blocks(self, ordered_blocks: Iterable[Any]) -> None:
        if not self._kvh.retention_active():
            _free_blocks(self, ordered_blocks)
            return
        blocks = list(ordered_blocks)
        _free_blocks(self, blocks)
        for block in blocks:
            if block.ref_cnt == 0 and block.block_hash is not None and block.pool in (None, self):
                self.kvh_refile_block(block)


class KvHintKVCacheManager(KVCacheManager):
    _kvh: VllmAdapter

    def get_computed_blocks(self, request):  # type: ignore[no-untyped-def]
        # Called when a waiting request is considered for admission (not per
        # decode step). A hit establishes session membership: the blocks are
        # resident and the session is about to use them.
        result = super().get_computed_blocks(request)
        if result[1]:
            self._kvh.on_prefix_hit(request, result[1])
        return result


def install(scheduler: Any, adapter: VllmAdapter) -> KvHintBlockPool:
    """Swap the scheduler's KV cache manager and block pool to the hooked classes."""
    manager = scheduler.kv_cache_manager
    if type(manager) is not KVCacheManager or type(manager.block_pool) is not BlockPool:
        raise RuntimeError(
            f"kvhint expects vLLM's stock KVCacheManager/BlockPool, got {type(manager).__name__}/"
            f"{type(manager.block_pool).__name__}"
        )
    pool = manager.block_pool
    pool.__class__ = KvHintBlockPool
    pool._kvh_init(adapter)
    manager.__class__ = KvHintKVCacheManager
    manager._kvh = adapter
    return pool
