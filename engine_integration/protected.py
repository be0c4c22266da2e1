"""Free cached blocks that a hint protects, kept outside vLLM's free queue.

vLLM evicts from the head of one LRU queue. Retained and pinned blocks are
taken out of that queue into these classes, so the queue holds only ordinary
blocks and is consumed first; when it runs dry, victims come from here:
retained blocks by ascending priority, then pinned blocks (a pin broken
under pressure). Every block here is still free: the pool counts it in
`get_num_free_blocks`, so protection never fails an allocation stock vLLM
would serve.

Within one (class, priority) bucket the order follows the blocks' expected
reuse (RetainAction/PinAction.expected_reuse_in, as a monotonic `reuse_at`):

  1. blocks with no expectation, and blocks whose expected time has passed,
     in LRU (filing) order;
  2. then blocks with an expected time still in the future, the furthest
     first (Belady with predictions; ties in LRU order).

With no expectations the bucket is a plain LRU, exactly the order without
this feature. Each operation is O(log n) amortized: an OrderedDict for the
LRU part, heaps with lazy deletion for the rest.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from kvhint_server.model import RetentionClass

KVCacheBlock = Any  # vllm.v1.core.kv_cache_utils.KVCacheBlock
Filing = tuple[RetentionClass, int, "float | None"]

_PLAIN, _AHEAD, _STALE = 0, 1, 2


class _Entry:
    __slots__ = ("block", "seq", "reuse_at", "state")

    def __init__(self, block: KVCacheBlock, seq: int, reuse_at: float | None) -> None:
        self.block = block
        self.seq = seq
        self.reuse_at = reuse_at
        self.state = _PLAIN if reuse_at is None else _AHEAD


class _Bucket:
    """The free blocks of one (class, priority), in the eviction order above."""

    __slots__ = ("entries", "plain", "stale", "ahead", "due")

    def __init__(self) -> None:
        self.entries: dict[int, _Entry] = {}
        self.plain: OrderedDict[int, _Entry] = OrderedDict()  # no expectation, filing order
        self.stale: list[tuple[int, int]] = []  # (seq, block_id): expectation passed
        self.ahead: list[tuple[float, int, int]] = []  # (-reuse_at, seq, block_id): furthest first
        self.due: list[tuple[float, int, int]] = []  # (reuse_at, seq, block_id): next to go stale first

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, block: KVCacheBlock, seq: int, reuse_at: float | None) -> None:
        entry = _Entry(block, seq, reuse_at)
        self.entries[block.block_id] = entry
        if reuse_at is None:
            self.plain[block.block_id] = entry
        else:
            heapq.heappush(self.ahead, (-reuse_at, seq, block.block_id))
            heapq.heappush(self.due, (reuse_at, seq, block.block_id))

    def remove(self, block_id: int) -> None:
        entry = self.entries.pop(block_id)
        if entry.state == _PLAIN:
            del self.plain[block_id]
        elif len(self.ahead) + len(self.stale) > 2 * len(self.entries) + 32:
            self._compact()

    def pop(self, now: float) -> KVCacheBlock | None:
        """Remove and return the next victim, or None when empty."""
        if not self.entries:
            return None
        self._expire(now)
        stale = self._valid_top(self.stale, _STALE, 0)
        plain_id = next(iter(self.plain), None)
        if plain_id is not None and (stale is None or self.plain[plain_id].seq < stale[0]):
            block_id = plain_id
        elif stale is not None:
            block_id = stale[1]
        else:
            top = self._valid_top(self.ahead, _AHEAD, 1)
            assert top is not None
            block_id = top[2]
        entry = self.entries[block_id]
        self.remove(block_id)
        return entry.block

    def _expire(self, now: float) -> None:
        """Move entries whose expected time has passed to the stale (LRU) part."""
        due, entries = self.due, self.entries
        while due and due[0][0] <= now:
            _, seq, block_id = heapq.heappop(due)
            entry = entries.get(block_id)
            if entry is not None and entry.seq == seq and entry.state == _AHEAD:
                entry.state = _STALE
                heapq.heappush(self.stale, (seq, block_id))

    def _valid_top(self, heap: list[Any], state: int, seq_at: int) -> Any:
        """The heap's top entry that is still filed in `state`, dropping stale ones."""
        entries = self.entries
        while heap:
            top = heap[0]
            entry = entries.get(top[-1])
            if entry is not None and entry.seq == top[seq_at] and entry.state == state:
                return top
            heapq.heappop(heap)
        return None

    def _compact(self) -> None:
        live = [e for e in self.entries.values() if e.state != _PLAIN]
        self.stale = [(e.seq, e.block.block_id) for e in live if e.state == _STALE]
        ahead = [e for e in live if e.state == _AHEAD]
        self.ahead = [(-e.reuse_at, e.seq, e.block.block_id) for e in ahead]  # type: ignore[operator]
        self.due = [(e.reuse_at, e.seq, e.block.block_id) for e in ahead]  # type: ignore[misc]
        for heap in (self.stale, self.ahead, self.due):
            heapq.heapify(heap)


class ProtectedFreeBlocks:
    """Protected free blocks by class, priority and expected reuse.

    `clock` is the monotonic clock that `reuse_at` values are measured on
    (the core's), read when victims are taken.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        # Number of blocks held here; a plain attribute because the pool reads
        # it on every allocation.
        self.count = 0
        self._clock = clock
        self._seq = itertools.count()
        # block id -> filing. Read-only outside this class: the pool's `touch` checks
        # membership here before calling `remove` (most touched free blocks are not filed).
        self.filed: dict[int, Filing] = {}
        self._retained: dict[int, _Bucket] = {}  # priority -> bucket
        self._pinned = _Bucket()

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.block_id in self.filed

    def filed_as(self, block: KVCacheBlock) -> Filing | None:
        """(class, priority, reuse_at) the block is filed under, or None."""
        return self.filed.get(block.block_id)

    def add(self, block: KVCacheBlock, cls: RetentionClass, priority: int, reuse_at: float | None = None) -> None:
        """File `block` (re-filing it if present) as the most recently freed of its bucket."""
        assert cls is not RetentionClass.ORDINARY
        self.remove(block)
        if cls is RetentionClass.PINNED:
            priority = 0
            bucket = self._pinned
        else:
            bucket = self._retained.get(priority) or self._retained.setdefault(priority, _Bucket())
        self.filed[block.block_id] = (cls, priority, reuse_at)
        self.count += 1
        bucket.add(block, next(self._seq), reuse_at)

    def remove(self, block: KVCacheBlock) -> bool:
        filed = self.filed.pop(block.block_id, None)
        if filed is None:
            return False
        self.count -= 1
        cls, priority, _ = filed
        if cls is RetentionClass.PINNED:
            self._pinned.remove(block.block_id)
        else:
            bucket = self._retained[priority]
            bucket.remove(block.block_id)
            if not bucket:
                del self._retained[priority]
        return True

    def take_victims(self, n: int) -> tuple[list[KVCacheBlock], list[KVCacheBlock]]:
        """Remove up to `n` blocks in eviction order. Returns (retained, pinned)."""
        now = self._clock()
        retained: list[KVCacheBlock] = []
        for priority in sorted(self._retained):
            if len(retained) >= n:
                break
            retained.extend(self._drain(self._retained[priority], n - len(retained), now))
            if not self._retained[priority]:
                del self._retained[priority]
        pinned = self._drain(self._pinned, n - len(retained), now)
        return retained, pinned

    def _drain(self, bucket: _Bucket, n: int, now: float) -> list[KVCacheBlock]:
        taken: list[KVCacheBlock] = []
        while len(taken) < n:
            block = bucket.pop(now)
            if block is None:
                break
            del self.filed[block.block_id]
            self.count -= 1
            taken.append(block)
        return taken

    def blocks(self) -> list[KVCacheBlock]:
        return [e.block for bucket in (self._pinned, *self._retained.values()) for e in bucket.entries.values()]
