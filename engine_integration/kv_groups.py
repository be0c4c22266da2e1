"""The KV-cache groups of a vLLM engine, and which of them define residency.

vLLM 0.32 gives a model one KV-cache group per attention type (a hybrid
model such as Gemma 2 has a sliding-window group and a full-attention group).
All groups share one BlockPool; its hash map is keyed by
`make_block_hash_with_group_id(hash, group_id)`, so one logical block (one
prefix-chain position, one BlockHash) has up to one cached copy per group.

A prefix hit needs every group to hit (HybridKVCacheCoordinator.
find_longest_cache_hit):

* full attention (`FullAttentionSpec` and subclasses): a copy of every block
  of the prefix;
* sliding window: copies of the `ceil((window - 1) / block_size)` blocks that
  end at the prefix end. Earlier blocks become null blocks in a running
  request (`remove_skipped_blocks`), and with vLLM's default
  `prefix_cache_retention_interval=0` only the window tail at each prompt's
  replay boundary is cached at all (`reachable_block_mask`).

KvHint's index is logical. A logical block is *resident* on the device when
every residency group holds a copy: the full-attention groups, or every
cacheable group when the model has no full-attention group. That is the
condition under which the block can be part of a prefix hit; the copies in
other groups are the window tails that a hit ending at that block also
needs, and hints act on them as well (see VllmAdapter). `residency_view`
states how KvHint's device events relate to vLLM's per-group, per-copy
KV events.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Container, Iterable
from dataclasses import dataclass
from typing import Any

from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

from kvhint_server.model import KvCacheGroupInfo, KvCacheGroupKind


def _kind(spec: Any) -> KvCacheGroupKind:
    if isinstance(spec, FullAttentionSpec):
        return KvCacheGroupKind.FULL_ATTENTION
    if isinstance(spec, SlidingWindowSpec):
        return KvCacheGroupKind.SLIDING_WINDOW
    return KvCacheGroupKind.OTHER


@dataclass(frozen=True)
class GroupLayout:
    """The cacheable groups of one engine and the residency rule above."""

    infos: tuple[KvCacheGroupInfo, ...]
    #: Group ids whose copies define residency (every one must hold a copy).
    residency: tuple[int, ...]
    #: Every prefix-cacheable group id (hints act on copies in all of them).
    cacheable: tuple[int, ...]

    def keys(self, digest: bytes, groups: tuple[int, ...] | None = None) -> list[bytes]:
        """The pool's hash-map keys of `digest` in `groups` (default: every cacheable group)."""
        return [make_block_hash_with_group_id(digest, g) for g in (self.cacheable if groups is None else groups)]


def layout_of(kv_cache_config: Any) -> GroupLayout:
    """The layout of a vLLM `KVCacheConfig` (one FULL group 0 when it is None)."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    infos: list[KvCacheGroupInfo] = []
    cacheable: list[int] = []
    for gid, group in enumerate(groups):
        spec = group.kv_cache_spec
        if not getattr(spec, "prefix_cacheable", True):
            continue
        kind = _kind(spec)
        window = int(getattr(spec, "sliding_window", 0) or 0) if kind is KvCacheGroupKind.SLIDING_WINDOW else 0
        infos.append(KvCacheGroupInfo(gid, kind, int(spec.block_size), window))
        cacheable.append(gid)
    if not infos:
        return GroupLayout((), (0,), (0,))
    full = tuple(i.group_id for i in infos if i.kind is KvCacheGroupKind.FULL_ATTENTION)
    residency = full or tuple(cacheable)
    infos = [
        KvCacheGroupInfo(i.group_id, i.kind, i.block_size, i.sliding_window_tokens, i.group_id in residency) for i in infos
    ]
    return GroupLayout(tuple(infos), residency, tuple(cacheable))


def residency_view(vllm_events: Iterable[Any], residency: Container[int]) -> list[tuple[str, Any, str]]:
    """vLLM's own KV events as KvHint's device events report them.

    vLLM publishes BlockStored / BlockRemoved per group (`group_idx`) and per
    copy: a hybrid model often holds two copies of a block in one group (a
    request that cannot hit a shared prefix, because the window group did not
    cache it, recomputes and caches it again). KvHint reports blocks, not
    copies, of the residency groups. So the agreement is: take vLLM's events
    of the residency groups, keep every store, and keep a removal only when it
    removes the hash's last copy there. Returns ("stored" | "removed", hash,
    medium) in vLLM's order; KvHint's BlocksStored (not prefix hits) and
    BlocksRemoved give the same list. (Exact with one residency group, the
    layout of the models tested here; with several, KvHint stores a block once
    the last of them holds a copy.)"""
    copies: Counter[Any] = Counter()
    out: list[tuple[str, Any, str]] = []
    for event in vllm_events:
        kind = type(event).__name__
        if kind not in ("BlockStored", "BlockRemoved") or event.group_idx not in residency:
            continue
        for h in event.block_hashes:
            if kind == "BlockStored":
                copies[h] += 1
                out.append(("stored", h, event.medium))
            else:
                copies[h] -= 1
                if copies[h] <= 0:
                    del copies[h]
                    out.append(("removed", h, event.medium))
    return out
