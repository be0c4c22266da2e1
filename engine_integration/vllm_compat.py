"""Whether the installed vLLM is the one KvHint's block-pool fast paths were written against.

KvHintBlockPool (hooks.py) repeats vLLM 0.32.0's own statements in two places, to spare a Python
frame per block on the paths every step takes:

  * allocation: `get_new_blocks` runs vLLM's statements with vLLM's eviction step
    (`_maybe_evict_cached_block`) written into its loop, and carries the removed keys to the
    step's next report;
  * freeing with a retention grant in effect: the hook finds the blocks vLLM's `free_blocks` just
    freed by walking back from the free queue's tail (vllm_private.appended_since), which is where
    that method puts the cached blocks it frees (and only those).

Another vLLM could change either method, and the copy or the walk would then be wrong without a
word: blocks lost from the pool's accounting, or a retained block freed and not protected. So
`check()` compares, once per process, the installed methods' statements with the ones written here
(their syntax trees, docstrings left out), and `hooks.install` turns a path off when its method
differs or its source cannot be read:

  * allocation: vLLM's own `get_new_blocks` runs (the hooks see each eviction through
    `_emit_block_removed_events`, as a broken pin's allocation does), and the removals are
    reported after each allocation instead of being carried;
  * freeing: the hook looks at the blocks it passed to vLLM's `free_blocks` itself (those left
    with no reference and a hash), through the public block attributes.

Both are slower and give the same results (tests/inproc/test_vllm_compat.py compares random
traffic and hints with both paths on and off; tests/inproc/test_hybrid_groups.py checks the
retention invariants either way). Each path turned off, and a vLLM version
other than the one these statements come from, is logged as a warning when the scheduler is
built; vllm_private.py lists every other vLLM internal KvHint reads.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any

# The vLLM release whose statements are written below (and the one CI runs).
TESTED_VLLM = "0.32.0"

# vLLM 0.32.0's BlockPool._maybe_evict_cached_block, without its docstring: the eviction step that
# KvHintBlockPool.get_new_blocks writes into its loop (the removed keys kept for one report per
# allocation instead of one _emit_block_removed_events per block).
EVICT_BODY = """
if self.metrics_collector:
    self.metrics_collector.on_block_evicted(block)
evicted_hashes = self._remove_cached_block_hashes(block)
if not evicted_hashes:
    return False
self._emit_block_removed_events(evicted_hashes)
return True
"""

# vLLM 0.32.0's BlockPool.get_new_blocks, without its docstring and comments: the statements that
# KvHintBlockPool.get_new_blocks repeats (the caching branch; without prefix caching it calls
# vLLM's method), with the eviction step above written into its loop in place of the
# `self._maybe_evict_cached_block(block)` call.
GET_NEW_BLOCKS_BODY = """
if num_blocks > self.get_num_free_blocks():
    raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
ret: list[KVCacheBlock] = self.free_block_queue.popleft_n(num_blocks)
if self._reuse_watchers:
    self._notify_reuse(ret)
if self.enable_caching:
    for block in ret:
        self._maybe_evict_cached_block(block)
        assert block.ref_cnt == 0
        block.ref_cnt += 1
        if self.metrics_collector:
            self.metrics_collector.on_block_allocated(block)
else:
    for block in ret:
        assert block.ref_cnt == 0
        block.ref_cnt += 1
        if self.metrics_collector:
            self.metrics_collector.on_block_allocated(block)
return ret
"""

# vLLM 0.32.0's BlockPool.free_blocks, without its docstring and comments: the cached blocks it
# frees go to the free queue's tail in their order, the uncached ones to its head, and nothing
# leaves the queue, so walking back from the tail to the mark taken before the call visits exactly
# the freed cached blocks (vllm_private.appended_since).
FREE_BLOCKS_BODY = """
blocks_to_evict_last = []
blocks_to_evict_first = []
other_pools: dict[BlockPool, list[KVCacheBlock]] = {}
for block in ordered_blocks:
    if block.pool is not None and block.pool is not self:
        other_pools.setdefault(block.pool, []).append(block)
        continue
    block.ref_cnt -= 1
    if block.ref_cnt == 0 and not block.is_null:
        if block.block_hash is None or not self.enable_caching:
            blocks_to_evict_first.append(block)
        else:
            blocks_to_evict_last.append(block)
self.free_block_queue.prepend_n(blocks_to_evict_first)
self.free_block_queue.append_n(blocks_to_evict_last)
for pool, blocks in other_pools.items():
    pool.free_blocks(blocks)
"""


@dataclass(frozen=True)
class Compat:
    """What the installed vLLM allows (module doc)."""

    fast_allocation: bool  # get_new_blocks and _maybe_evict_cached_block are the statements above
    free_tail_walk: bool  # free_blocks is the statements above
    warnings: tuple[str, ...]  # one per path turned off, and one for another vLLM version


def body_dump(function: Any) -> list[str]:
    """The syntax tree of `function`'s statements, its docstring left out (OSError or TypeError
    when its source cannot be read)."""
    [fn] = ast.parse(textwrap.dedent(inspect.getsource(function))).body
    body = fn.body  # type: ignore[attr-defined]
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
        body = body[1:]
    return [ast.dump(s) for s in body]


def _differs(pool_cls: type, method: str, expected: str) -> str | None:
    """None when `pool_cls.<method>` is `expected`; else why not."""
    name = f"{pool_cls.__name__}.{method}"
    try:
        found = body_dump(getattr(pool_cls, method))
    except (OSError, TypeError, SyntaxError, ValueError) as error:
        return f"the source of vLLM's {name} cannot be read ({error})"
    if found != [ast.dump(s) for s in ast.parse(expected).body]:
        return f"vLLM's {name} is not vLLM {TESTED_VLLM}'s"
    return None


@functools.lru_cache(maxsize=8)
def check(pool_cls: type | None = None, version: str | None = None) -> Compat:
    """Compare vLLM's BlockPool (or `pool_cls`) with the statements above, and `version` (the
    installed vLLM's by default) with TESTED_VLLM."""
    if pool_cls is None:
        from vllm.v1.core.block_pool import BlockPool

        pool_cls = BlockPool
    if version is None:
        import vllm

        version = str(getattr(vllm, "__version__", "unknown"))
    warnings = []
    if version.split("+")[0] != TESTED_VLLM:
        warnings.append(
            f"vLLM {version} is not the release KvHint is tested with ({TESTED_VLLM}); the vLLM internals it reads are "
            "listed in engine_integration/vllm_private.py"
        )
    alloc = [why for why in (_differs(pool_cls, "get_new_blocks", GET_NEW_BLOCKS_BODY),
                             _differs(pool_cls, "_maybe_evict_cached_block", EVICT_BODY)) if why]
    if alloc:
        warnings.append(f"{'; '.join(alloc)}: allocations run vLLM's own get_new_blocks, their removals reported "
                        "after each one (slower, same results)")
    free = _differs(pool_cls, "free_blocks", FREE_BLOCKS_BODY)
    if free:
        warnings.append(f"{free}: with a retention grant in effect, the free hook looks at every block it frees "
                        "(slower, same results)")
    return Compat(fast_allocation=not alloc, free_tail_walk=free is None, warnings=tuple(warnings))
