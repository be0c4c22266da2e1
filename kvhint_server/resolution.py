"""Selector resolution: which logical blocks a validated Selector names, and on
which tiers each one is. One module for the executor (hints) and the queries
(QueryResidency), so a hint and a query of the same selector see the same
blocks.

Engine thread only: reads the SessionPrefixIndex and, for hashes the index
does not track, asks the EngineAdapter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .model import Selector, SelectorKind

if TYPE_CHECKING:
    from .core import KvHintCore


def resolve(core: KvHintCore, selector: Selector) -> list[bytes]:
    """Block hashes the selector names, in chain order (range applied). May
    include blocks with no resident copy (parent-only nodes)."""
    index = core.index
    if selector.kind is SelectorKind.SESSION:
        hashes = index.resolve_session(selector.session_id, selector.include_children)
    elif selector.kind is SelectorKind.CONTINUATION:
        hashes = index.resolve_continuation(selector.continuation_id)
    else:
        return _chain_ordered(core, selector.block_hashes)
    if selector.has_range:
        end = selector.range_end if selector.range_end is not None else 1 << 62
        nodes = index.nodes
        hashes = [h for h in hashes if selector.range_start <= nodes[h].position < end]
    return hashes


def _chain_ordered(core: KvHintCore, hashes: Sequence[bytes]) -> list[bytes]:
    """Explicit hashes in chain order (position ascending: what max_blocks takes from the start
    or the end of, and the order QueryResidency reports; several chains interleave by position,
    equal positions in request order), whatever order they were sent in.
    Positions come from the index, else from the engine; hashes with no known position keep
    their request order, after the others."""
    index = core.index
    positions: dict[bytes, int] = {}
    unknown: list[bytes] = []
    for h in hashes:
        node = index.node(h)
        if node is not None:
            positions[h] = node.position
        else:
            unknown.append(h)
    if unknown:
        for h, state in core.adapter.lookup(unknown).items():
            if state.position is not None:
                positions[h] = state.position
    last = 1 << 62
    order = {h: i for i, h in enumerate(hashes)}
    return sorted(hashes, key=lambda h: (positions.get(h, last), order[h]))


def tiers_of(core: KvHintCore, hashes: Sequence[bytes]) -> dict[bytes, int]:
    """Tier bitmask per hash (the index for tracked blocks, the adapter for the rest)."""
    index = core.index
    out: dict[bytes, int] = {}
    unknown: list[bytes] = []
    for h in hashes:
        node = index.node(h)
        if node is None:
            unknown.append(h)
        else:
            out[h] = node.tiers
    if unknown:
        for h, state in core.adapter.lookup(unknown).items():
            out[h] = state.tiers
    return out
