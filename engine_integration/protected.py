"""Free cached blocks that a hint protects, kept outside vLLM's free queue.

vLLM evicts from the head of one LRU queue. Retained and pinned blocks are
taken out of that queue into these classes, so the queue holds only ordinary
blocks and is consumed first; when it runs dry, victims come from here:
retained blocks by ascending priority (LRU within a priority), then pinned
blocks (a pin broken under pressure). Every block here is still free: the
pool counts it in `get_num_free_blocks`, so protection never fails an
allocation stock vLLM would serve.
"""

from __future__ import annotations

from typing import Any

from kvhint_server.model import RetentionClass

KVCacheBlock = Any  # vllm.v1.core.kv_cache_utils.KVCacheBlock


class ProtectedFreeBlocks:
    def __init__(self) -> None:
        # Number of blocks held here; a plain attribute because the pool reads
        # it on every allocation.
        self.count = 0
        self._class_of: dict[int, tuple[RetentionClass, int]] = {}
        self._retained: dict[int, dict[int, KVCacheBlock]] = {}  # priority -> LRU-ordered blocks
        self._pinned: dict[int, KVCacheBlock] = {}

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.block_id in self._class_of

    def filed_as(self, block: KVCacheBlock) -> tuple[RetentionClass, int] | None:
        return self._class_of.get(block.block_id)

    def add(self, block: KVCacheBlock, cls: RetentionClass, priority: int) -> None:
        assert cls is not RetentionClass.ORDINARY
        self.remove(block)
        self._class_of[block.block_id] = (cls, priority)
        self.count += 1
        if cls is RetentionClass.PINNED:
            self._pinned[block.block_id] = block
        else:
            self._retained.setdefault(priority, {})[block.block_id] = block

    def remove(self, block: KVCacheBlock) -> bool:
        filed = self._class_of.pop(block.block_id, None)
        if filed is None:
            return False
        self.count -= 1
        cls, priority = filed
        if cls is RetentionClass.PINNED:
            del self._pinned[block.block_id]
        else:
            bucket = self._retained[priority]
            del bucket[block.block_id]
            if not bucket:
                del self._retained[priority]
        return True

    def take_victims(self, n: int) -> tuple[list[KVCacheBlock], list[KVCacheBlock]]:
        """Remove up to `n` blocks in eviction order. Returns (retained, pinned)."""
        retained: list[KVCacheBlock] = []
        for priority in sorted(self._retained):
            if len(retained) >= n:
                break
            bucket = self._retained[priority]
            for block in list(bucket.values())[: n - len(retained)]:
                retained.append(block)
        for block in retained:
            self.remove(block)
        pinned = list(self._pinned.values())[: n - len(retained)]
        for block in pinned:
            self.remove(block)
        return retained, pinned

    def blocks(self) -> list[KVCacheBlock]:
        return [*self._pinned.values(), *(b for bucket in self._retained.values() for b in bucket.values())]
