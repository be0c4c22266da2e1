"""Which blocks of a Retain or Pin a resume can hit, on an engine whose KV-cache groups include
sliding-window ones (KvCacheGroup KIND_SLIDING_WINDOW; Reason WINDOW_TAIL_MISSING). The executor
trims a clipped hint to them, and grants an unclipped one nothing when there are none and its
chains end within it (`continues_beyond`).

A prefix hit of the blocks up to and including block `e` needs, in every full-attention group,
a copy of each of those blocks, and in every sliding-window group a copy of the `n` blocks
ending at `e` (all of them when the chain is shorter), with `n = ceil((window_tokens - 1) /
block_size)`: the proto's KvCacheGroup contract, which is vLLM's rule
(SlidingWindowManager.find_longest_cache_hit). Call `e` a *hit end* when the engine holds those
window copies now. A resume of the chain can end its hit only at a hit end, so of the blocks a
block budget kept, those that no kept hit end follows on their chain (with every block between
them kept) protect nothing a resume reads: `resumable` drops them.

The engine's window copies are asked for through `EngineAdapter.device_groups`; the chain comes
from the index's parent links. Where the rule cannot be judged, nothing is dropped: a group of
another kind (Mamba state), a group whose block size is not the engine's hash block size, a
kept block without a device copy (a Retain also covers blocks only a lower tier holds), or, for
one group, a window reaching an ancestor the index does not know (the other groups' windows are
still judged).

Engine thread only (reads the index and asks the adapter).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from .model import EngineInfo, KvCacheGroupKind, Tier

if TYPE_CHECKING:
    from .core import KvHintCore


def window_blocks(info: EngineInfo) -> list[tuple[int, int]] | None:
    """(group bit, window blocks) of each sliding-window group: empty when the engine has none
    (every prefix of a resident chain is a hit), None when the rule cannot be judged."""
    out = []
    for g in info.kv_cache_groups:
        if g.kind is KvCacheGroupKind.SLIDING_WINDOW:
            if g.block_size != info.block_size or g.sliding_window_tokens <= 0:
                return None
            out.append((1 << g.group_id, max(1, -(-(g.sliding_window_tokens - 1) // g.block_size))))
        elif g.kind is not KvCacheGroupKind.FULL_ATTENTION:
            return None
    return out


def continues_beyond(core: KvHintCore, selected: list[bytes]) -> bool:
    """Whether a chain through `selected` goes on past it in the index: a selected block with a
    tracked child that is not selected (a later turn, another session's longer prompt, blocks
    after a range). A hit end out there reads the selected blocks too, so they are not judged by
    the hit ends among them alone."""
    nodes = core.index.nodes
    inside: dict[bytes, int] = {}
    for h in selected:
        node = nodes.get(h)
        if node is not None and node.parent is not None:
            inside[node.parent] = inside.get(node.parent, 0) + 1
    for h in selected:
        node = nodes.get(h)
        if node is not None and node.children > inside.get(h, 0):
            return True
    return False


def resumable(core: KvHintCore, kept: list[bytes], tiers: Mapping[bytes, int]) -> list[bytes]:
    """The blocks of `kept` (chain order; `tiers`: their tier masks) that some kept hit end
    follows on their chain, in the same order."""
    groups = window_blocks(core.info)
    if not groups or not kept or any(not tiers.get(h, 0) & Tier.DEVICE.bit for h in kept):
        return kept
    nodes = core.index.nodes
    depth = max(n for _, n in groups)
    # The kept blocks and the ancestors whose window copies a hit ending at one of them reads.
    asked: set[bytes] = set()
    for h in kept:
        b: bytes | None = h
        for _ in range(depth):
            if b is None:
                break
            asked.add(b)
            node = nodes.get(b)
            b = node.parent if node is not None else None
    held = core.adapter.device_groups(list(asked))

    def hit_end(e: bytes) -> bool:
        for bit, n in groups:
            b: bytes | None = e
            for _ in range(n):
                node = nodes.get(b) if b is not None else None
                if node is None:
                    break  # the chain above is unknown here: this group's window is not judged
                if not held.get(b, 0) & bit:  # type: ignore[arg-type]
                    return False
                if node.position == 0:
                    break  # the chain's first block: a shorter window is the whole chain
                b = node.parent
        return True

    keep = set(kept)
    useful: set[bytes] = set()
    for e in reversed(kept):  # deepest first, so each walk stops at a block already marked
        if e in useful or not hit_end(e):
            continue
        b = e
        while b is not None and b in keep and b not in useful:
            useful.add(b)
            node = nodes.get(b)
            b = node.parent if node is not None else None
    return [h for h in kept if h in useful]
