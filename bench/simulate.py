"""Offline prefix-cache simulators over a trace's block sequence.

All simulators execute requests one at a time, in trace order (a sequential
engine), over the content-chained block ids of `bench.trace.chain_hashes`.
Each returns a `SimResult`: per-request cached (prefix-hit) tokens, the hit
rate over prompt tokens, recomputed prompt tokens and peak blocks in use.

Per request the model follows vLLM 0.32's KVCacheManager / BlockPool for a
single full-attention group with ``block_size == hash_block_size`` and
synchronous scheduling (vLLM forces ``async_scheduling=False`` on CPU):

1. hit = longest run of cached full prompt blocks from the start, at most
   ``(P - 1) // block_size`` blocks (``max_cache_hit_length = num_tokens - 1``);
   a hash with several cached copies resolves to the first-inserted copy
   (``BlockHashToBlockMap.get_one_block``).
2. touch the hit blocks (a free hit block leaves the free queue).
3. allocate ``ceil((P + O - 1) / bs) - hit`` new blocks: every computed token
   needs a slot, and the last sampled token is never fed back, so ``P + O - 1``
   tokens are computed for ``O = max_tokens`` (requests run to ``max_tokens``,
   i.e. ``ignore_eos``). LRU pops them from the free-queue head; a popped block
   loses its cached hash (eviction).
4. cache every full block of the computed tokens that is not a hit:
   ``floor((P + O - 1) / bs)`` blocks, decode (output-token) blocks included
   (Request.append_output_token_ids extends block_hashes and allocate_slots
   caches ``min(computed + new, num_tokens)`` tokens each step). With
   ``async_scheduling=True`` (GPU default) caching lags one token:
   ``floor((P + O - 2) / bs)``. A recomputed block whose hash is already
   cached becomes a duplicate entry (vLLM does not de-duplicate).
5. free the request's blocks in reverse order: blocks whose ref count drops
   to 0 go to the free queue -- hashed ones appended at the tail (tail of the
   chain first, so it is evicted first), unhashed ones (the partial last
   block) prepended at the head (``BlockPool.free_blocks``).

The null block takes one slot: ``num_gpu_blocks - 1`` blocks are usable.
Chunked prefill does not change this for a sequential engine (pops and caching
happen in the same order).

Policies differ only in which free blocks a request's new blocks evict:

* `simulate_lru` -- the free-queue head (stock vLLM).
* `simulate_belady` -- the cached free block whose next use (the next
  request whose hit-able prefix contains its hash) is farthest; ties: deeper
  chain position first, then queue order; unhashed blocks, non-primary
  duplicate copies and orphans (chain parent not cached) first. A
  clairvoyant reference, NOT a proven optimum for prefix chains (a hit needs
  the whole chain up to that block, which block-level MIN ignores; victims are
  chosen once per request, and it never bypasses caching).
* `simulate_infinite` -- no eviction: the hit is the longest prefix computed
  by any earlier request.
* `simulate_hinted` -- free-pool classes of docs/design.md §4 driven by
  `bench.policy`: unhashed first, then blocks whose every owning session was
  Released, then ordinary blocks, then Retained blocks by ascending priority,
  then Pinned blocks (within a pin budget; evicting one is a "pin broken"),
  queue (LRU) order within a class. TTLs are checked against the trace clock
  (a request runs at its sequential start time). Hints act on the target's
  block ids at the time of the hint: a session's latest chain (prompt +
  cached decode blocks), or the shared prefix's blocks. A Pin covers only
  resident blocks, head of the chain first, up to the pin budget (the rest is
  clipped). A block is "released" only if every session that ever held it
  was Released, so shared blocks keep other sessions' protection. Each
  target has one pin slot and one retain slot; a new hint of the same kind
  replaces the old one; Release clears both. Expected reuse
  (``expected_reuse_in_s``, clamped to the TTL) orders blocks within a
  (class, priority) as kvhint.v1 specifies and
  `engine_integration.protected` implements: no or a passed expectation
  first in queue (LRU) order, then the furthest expected reuse first; a
  block's expectation is the earliest among its unexpired hints.
* `simulate_library` -- the same pool driven by `bench.policy.LibraryPolicy`
  (`kvhint_client.policy.SessionPolicy`), which also sees the runtime's own
  requests (to learn pause durations) and ticks before each request;
  `learned_pause_state` is what it learned over a whole trace, which a
  warm-started run (``pause_state=``) of another trace starts from.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Union

import numpy as np

from bench.policy import (
    Action,
    Demote,
    LibraryPolicy,
    Pin,
    PolicyConfig,
    Prefetch,
    ReferencePolicy,
    Release,
    Retain,
    Target,
    library_config,
    policy_variant,
    shared_prefix_target,
)
from bench.trace import Request, Signal, Trace, chain_hashes

# --------------------------------------------------------------------------- block trace


@dataclass(frozen=True)
class BlockRequest:
    index: int  # position among the trace's requests
    request_id: str
    session_id: str
    parent_session_id: str | None
    t: float  # start of execution on a sequential engine
    num_prompt_tokens: int
    max_tokens: int
    chain: tuple[int, ...]  # ids of the blocks cached at the end (prompt + decode)
    hit_cap_blocks: int  # (P - 1) // bs
    num_alloc_blocks: int  # ceil((P + O - 1) / bs)
    t_done: float = -math.inf  # completion on the sequential engine (its start when the trace has no t_done)

    @property
    def num_cached_end(self) -> int:
        return len(self.chain)


BlockItem = Union[BlockRequest, Signal]


@dataclass
class BlockTrace:
    block_size: int
    num_gpu_blocks: int
    items: list[BlockItem]  # event order
    requests: list[BlockRequest]
    shared_prefix_hashes: tuple[int, ...] = ()
    shared_prefix_target: Target | None = None
    policy_config: PolicyConfig = field(default_factory=PolicyConfig)
    library_config: Any = None  # kvhint_client.policy.PolicyConfig for `simulate_library`

    @property
    def prompt_tokens(self) -> int:
        return sum(r.num_prompt_tokens for r in self.requests)


def compile_trace(
    trace: Trace,
    *,
    num_gpu_blocks: int | None = None,
    async_scheduling: bool = False,
    outputs: dict[str, Sequence[int]] | None = None,
) -> BlockTrace:
    """Expand every request to its block-id chain (prompt and computed output)."""
    bs = trace.header.block_size
    lag = 1 if async_scheduling else 0
    reqs: list[BlockRequest] = []
    busy_until = -math.inf  # sequential engine: a request starts when the previous completed
    for e in trace.events:
        if not isinstance(e, Request):
            continue
        prompt = trace.expand_prompt_array(e, outputs)
        p, o = prompt.size, e.max_tokens
        if outputs is not None and e.request_id in outputs:
            gen = np.asarray(outputs[e.request_id], dtype=np.int64)
        else:
            gen = trace.output_placeholder(e)
        computed = np.concatenate([prompt, gen[: max(0, o - 1 - lag)]])
        ncached = max(0, p + o - 1 - lag) // bs
        chain = chain_hashes(computed[: ncached * bs], bs)
        start = max(e.t, busy_until)
        if e.t_done is not None:
            busy_until = max(busy_until, e.t_done)
        reqs.append(
            BlockRequest(
                index=len(reqs),
                request_id=e.request_id,
                session_id=e.session_id,
                parent_session_id=e.parent_session_id,
                t=start,
                num_prompt_tokens=p,
                max_tokens=o,
                chain=tuple(chain),
                hit_cap_blocks=(p - 1) // bs,
                num_alloc_blocks=-(-(p + o - 1) // bs),
                t_done=start if e.t_done is None else max(start, e.t_done),
            )
        )
    # Merge: a signal is applied before a request iff it is no later than the
    # request's (sequential) start time; signals keep their file order.
    sigs = [e for e in trace.events if not isinstance(e, Request)]
    out_items: list[BlockItem] = []
    j = 0
    for r in reqs:
        while j < len(sigs) and sigs[j].t <= r.t:
            out_items.append(sigs[j])
            j += 1
        out_items.append(r)
    out_items.extend(sigs[j:])
    sp_hashes: tuple[int, ...] = ()
    if trace.header.shared_prefix:
        sp_hashes = tuple(chain_hashes(trace.shared_prefix_tokens(), bs))
    return BlockTrace(
        block_size=bs,
        num_gpu_blocks=num_gpu_blocks if num_gpu_blocks is not None else trace.header.num_gpu_blocks,
        items=out_items,
        requests=reqs,
        shared_prefix_hashes=sp_hashes,
        shared_prefix_target=shared_prefix_target(trace.header),
        policy_config=PolicyConfig.from_header(trace.header),
        library_config=library_config(trace.header),
    )


# --------------------------------------------------------------------------- results


@dataclass
class SimResult:
    name: str
    cached_tokens: list[int]
    prompt_tokens: int
    peak_blocks_in_use: int
    evictions: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def hit_tokens(self) -> int:
        return sum(self.cached_tokens)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def recomputed_tokens(self) -> int:
        return self.prompt_tokens - self.hit_tokens

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "prompt_tokens": self.prompt_tokens,
            "hit_tokens": self.hit_tokens,
            "hit_rate": round(self.hit_rate, 4),
            "recomputed_tokens": self.recomputed_tokens,
            "peak_blocks_in_use": self.peak_blocks_in_use,
            "evictions": self.evictions,
            **self.extra,
        }


# --------------------------------------------------------------------------- pool


class BlockPoolModel:
    """vLLM BlockPool + FreeKVCacheBlockQueue bookkeeping (single group).

    The free queue is an OrderedDict (head = next to evict); ``map`` is
    hash -> block ids in insertion order (duplicates allowed, as in
    BlockHashToBlockMap); block 0 is the null block and never free.
    """

    def __init__(self, num_gpu_blocks: int):
        if num_gpu_blocks < 2:
            raise ValueError("need at least 2 blocks (one is vLLM's null block)")
        self.num_gpu_blocks = num_gpu_blocks
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_gpu_blocks))
        self.block_hash: list[int | None] = [None] * num_gpu_blocks
        self.ref = [0] * num_gpu_blocks
        self.map: dict[int, list[int]] = {}
        self.evictions = 0

    @property
    def usable(self) -> int:
        return self.num_gpu_blocks - 1

    def lookup(self, chain: Sequence[int], cap: int) -> list[int]:
        hits: list[int] = []
        for h in itertools.islice(chain, cap):
            lst = self.map.get(h)
            if not lst:
                break
            hits.append(lst[0])
        return hits

    def touch(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1

    def head(self, n: int) -> list[int]:
        return list(itertools.islice(self.free, n))

    def take(self, victims: Sequence[int]) -> None:
        for b in victims:
            del self.free[b]
            h = self.block_hash[b]
            if h is not None:
                lst = self.map[h]
                lst.remove(b)
                if not lst:
                    del self.map[h]
                self.block_hash[b] = None
                self.evictions += 1
            assert self.ref[b] == 0
            self.ref[b] = 1

    def cache(self, b: int, h: int) -> None:
        assert self.block_hash[b] is None
        self.block_hash[b] = h
        self.map.setdefault(h, []).append(b)

    def free_request(self, blocks: Sequence[int]) -> None:
        first: list[int] = []
        last: list[int] = []
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                (first if self.block_hash[b] is None else last).append(b)
        for b in reversed(first):  # prepend_n keeps `first` order at the head
            self.free[b] = None
            self.free.move_to_end(b, last=False)
        for b in last:
            self.free[b] = None

    def resident(self, h: int) -> bool:
        return h in self.map


Chooser = Callable[[BlockPoolModel, int, BlockRequest], list[int]]


class HostTier:
    """A host-memory tier of `capacity` blocks, kept the way vLLM's OffloadingConnector keeps
    its CPU tier: every newly computed full block is stored (most recent first kept), a block
    loaded back is touched, and the least recently used block is dropped when full.

    `order` (set by `HintedPool` for `simulate_tiers(host_retention=True)`; None: LRU) models a
    host tier that honours retention (the engine's opt-in host policy, kvhint.v1
    TierInfo.honours_retention): given the host's blocks from least to most recently used, it
    returns them in the order the tier drops them."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.loaded_blocks = 0
        self.order: Callable[[list[int]], list[int]] | None = None

    def __contains__(self, h: int) -> bool:
        return h in self.lru

    def store(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self.lru[h] = None
            self.lru.move_to_end(h)
        over = len(self.lru) - self.capacity
        if over <= 0:
            return
        if self.order is None:
            for _ in range(over):
                self.lru.popitem(last=False)
            return
        for h in self.order(list(self.lru))[:over]:
            del self.lru[h]


def _run_request(pool: BlockPoolModel, req: BlockRequest, choose: Chooser, host: HostTier | None = None) -> tuple[int, int]:
    """Execute one request; returns (hit blocks, blocks in use at peak). With a `host` tier,
    the blocks after the device prefix hit that the host holds are loaded (they count as hit
    blocks: not recomputed), and the newly computed blocks are stored to the host."""
    hits = pool.lookup(req.chain, req.hit_cap_blocks)
    pool.touch(hits)
    loaded = 0
    if host is not None:
        while len(hits) + loaded < req.hit_cap_blocks and req.chain[len(hits) + loaded] in host:
            loaded += 1
        host.loaded_blocks += loaded
    n_new = req.num_alloc_blocks - len(hits)
    if n_new > len(pool.free):
        raise ValueError(
            f"request {req.request_id} needs {n_new} new blocks, only {len(pool.free)} free"
            f" (pool of {pool.num_gpu_blocks} blocks is too small for this trace)"
        )
    victims = choose(pool, n_new, req) if n_new > 0 else []
    assert len(victims) == n_new and len(set(victims)) == n_new
    pool.take(victims)
    blocks = hits + victims
    for i in range(len(hits), len(req.chain)):
        pool.cache(blocks[i], req.chain[i])
    pool.free_request(blocks)
    if host is not None:
        host.store(req.chain[len(hits) :])  # loaded blocks are touched, computed ones stored
    return len(hits) + loaded, len(blocks)


def _lru_choose(pool: BlockPoolModel, n: int, req: BlockRequest) -> list[int]:
    return pool.head(n)


def _simulate(name: str, bt: BlockTrace, choose: Chooser, num_gpu_blocks: int | None) -> SimResult:
    pool = BlockPoolModel(num_gpu_blocks or bt.num_gpu_blocks)
    cached: list[int] = []
    peak = 0
    for req in bt.requests:
        nhit, inuse = _run_request(pool, req, choose)
        cached.append(nhit * bt.block_size)
        peak = max(peak, inuse)
    return SimResult(name, cached, bt.prompt_tokens, peak, pool.evictions)


def simulate_lru(bt: BlockTrace, num_gpu_blocks: int | None = None) -> SimResult:
    """Stock vLLM prefix caching (LRU free queue), sequential execution."""
    return _simulate("lru", bt, _lru_choose, num_gpu_blocks)


def next_use_index(bt: BlockTrace) -> dict[int, list[int]]:
    """hash -> sorted request indices whose hit-able prefix contains it."""
    uses: dict[int, list[int]] = {}
    for r in bt.requests:
        for h in r.chain[: r.hit_cap_blocks]:
            uses.setdefault(h, []).append(r.index)
    return uses


def belady_chooser(bt: BlockTrace) -> Callable[[BlockPoolModel, int, int], list[int]]:
    """Belady-MIN's victim choice over `bt`: choose(pool, n, position) returns the
    n free blocks to evict when request `position` (an index into bt.requests)
    is the latest one to have started.

    Uncached free blocks go first; then the cached block whose next use (the
    next request after `position` whose hit-able prefix contains its hash) is
    furthest, a block no request can hit counting as never used: a duplicate
    copy that is not the one lookups return, or a block whose chain parent is
    no longer cached (an orphan). Ties: deepest in its chain, then LRU order.
    """
    uses = next_use_index(bt)
    depth: dict[int, int] = {}
    parent: dict[int, int] = {}
    for r in bt.requests:
        for i, h in enumerate(r.chain):
            depth[h] = i
            if i:
                parent[h] = r.chain[i - 1]
    inf = math.inf

    def choose(pool: BlockPoolModel, n: int, position: int) -> list[int]:
        keyed = []
        cached = pool.map
        for pos, b in enumerate(pool.free):
            h = pool.block_hash[b]
            if h is None:
                keyed.append(((0, 0.0, 0, pos), b))
                continue
            nxt: float = inf
            ph = parent.get(h)
            if cached[h][0] == b and (ph is None or ph in cached):
                lst = uses.get(h)
                if lst:
                    j = bisect.bisect_right(lst, position)
                    if j < len(lst):
                        nxt = lst[j]
            keyed.append(((1, -nxt, -depth.get(h, 0), pos), b))
        keyed.sort(key=lambda kb: kb[0])
        return [b for _, b in keyed[:n]]

    return choose


def simulate_belady(bt: BlockTrace, num_gpu_blocks: int | None = None) -> SimResult:
    """Belady-MIN over block ids (clairvoyant reference, see module doc and
    `belady_chooser`), sequential execution."""
    choose = belady_chooser(bt)
    return _simulate("belady", bt, lambda pool, n, req: choose(pool, n, req.index), num_gpu_blocks)


def simulate_infinite(bt: BlockTrace) -> SimResult:
    """Unbounded cache: every computed full block stays cached."""
    seen: set[int] = set()
    cached: list[int] = []
    peak = 0
    for r in bt.requests:
        n = 0
        for h in itertools.islice(r.chain, r.hit_cap_blocks):
            if h not in seen:
                break
            n += 1
        cached.append(n * bt.block_size)
        seen.update(r.chain)
        peak = max(peak, r.num_alloc_blocks)
    return SimResult("infinite", cached, bt.prompt_tokens, peak, 0, {"distinct_blocks": len(seen)})


# --------------------------------------------------------------------------- hint-aware


@dataclass(frozen=True)
class _HintState:
    kind: str  # "pin" | "retain"
    deadline: float = math.inf
    priority: int = 0
    hashes: frozenset[int] = frozenset()
    reuse_at: float | None = None  # expected reuse (absolute), at most the deadline


class HintedPool:
    """Free-pool classes (docs/design.md §4) on top of `BlockPoolModel`."""

    T_UNHASHED, T_RELEASED, T_ORDINARY, T_RETAINED, T_PINNED = range(5)

    def __init__(self, bt: BlockTrace, num_gpu_blocks: int | None, pin_budget_fraction: float, host: HostTier | None = None):
        self.bt = bt
        self.host = host
        self.demoted: set[str] = set()
        self.pool = BlockPoolModel(num_gpu_blocks or bt.num_gpu_blocks)
        self.pin_budget = int(pin_budget_fraction * self.pool.usable)
        self.now = 0.0
        self.owners: dict[int, set[str]] = {}
        self.chain_of: dict[str, tuple[int, ...]] = {}
        # one pin slot and one retain slot per target; a new hint of the same
        # kind replaces the previous one, Release clears both
        self.pins: dict[Target, _HintState] = {}
        self.retains: dict[Target, _HintState] = {}
        self.released: set[str] = set()
        # `_protection()`'s last result, reused until a hint changes (`apply` drops it) or one it
        # counted expires: (computed at, valid before, result).
        self._protection_cache: tuple[float, float, Any] | None = None
        self.stats = {"pins": 0, "pins_clipped_blocks": 0, "pins_broken": 0, "retains": 0, "releases": 0, "demotes": 0}

    # ---- hints
    def _target_hashes(self, tgt: Target) -> tuple[int, ...]:
        if tgt.kind == "session":
            return self.chain_of.get(tgt.id, ())
        if tgt.kind == "prefix":
            n = len(self.bt.shared_prefix_hashes)
            if tgt.num_tokens is not None:
                n = min(n, tgt.num_tokens // self.bt.block_size)
            return self.bt.shared_prefix_hashes[:n]
        raise ValueError(f"unknown target kind {tgt.kind}")

    def _active_pinned(self, exclude: Target | None = None) -> set[int]:
        out: set[int] = set()
        for tgt, st in self.pins.items():
            if st.deadline > self.now and tgt != exclude:
                out |= st.hashes
        return out

    def apply(self, a: Action, t: float) -> None:
        self.now = max(self.now, t)
        tgt = a.target
        if isinstance(a, Pin):
            self.stats["pins"] += 1
            chain = self._target_hashes(tgt)
            pinned = self._active_pinned(exclude=tgt)
            room = self.pin_budget - len(pinned)
            chosen: list[int] = []
            for h in chain:  # prefix order: a clipped pin keeps the chain head
                if not self.pool.resident(h) or h in pinned:
                    continue
                if len(chosen) >= room:
                    break
                chosen.append(h)
            resident = sum(1 for h in chain if self.pool.resident(h) and h not in pinned)
            self.stats["pins_clipped_blocks"] += resident - len(chosen)
            self.pins[tgt] = _HintState("pin", t + a.ttl_s, 0, frozenset(chosen), _reuse_at(a, t))
            self.released.discard(tgt.id)
        elif isinstance(a, Retain):
            self.stats["retains"] += 1
            self.retains[tgt] = _HintState(
                "retain", t + a.ttl_s, a.priority, frozenset(self._target_hashes(tgt)), _reuse_at(a, t)
            )
            self.released.discard(tgt.id)
        elif isinstance(a, Release):
            self.stats["releases"] += 1
            self.pins.pop(tgt, None)
            self.retains.pop(tgt, None)
            if tgt.kind == "session":
                self.released.add(tgt.id)
        elif isinstance(a, Demote) and self.host is not None and tgt.kind == "session":
            # A host copy is made (the chain becomes the host's most recent), then the device
            # copies go first; the target's device retention ends.
            self.stats["demotes"] += 1
            self.host.store([h for h in self._target_hashes(tgt) if self.pool.resident(h) or h in self.host])
            self.pins.pop(tgt, None)
            self.retains.pop(tgt, None)
            self.demoted.add(tgt.id)
        elif isinstance(a, (Demote, Prefetch)):
            pass  # no host tier; and with one, Prefetch stages into the host, which already holds it
        else:  # pragma: no cover
            raise TypeError(a)
        # Dropped once every change is made: a Demote's host store runs host_order, which may
        # compute (and cache) the protection before its hints are popped.
        self._protection_cache = None

    # ---- eviction order
    def _protection(self) -> tuple[set[int], dict[int, int], dict[int, float]]:
        """(pinned blocks, retained block -> highest priority, block -> earliest expected reuse)
        of the unexpired hints. Callers only read the result."""
        now = self.now
        cached = self._protection_cache
        if cached is not None and cached[0] <= now < cached[1]:
            return cached[2]
        pinned: set[int] = set()
        retained: dict[int, int] = {}
        reuse: dict[int, float] = {}  # block -> earliest expected reuse among its unexpired hints
        valid_before = math.inf  # the first deadline among the hints counted
        for st in self.pins.values():
            if st.deadline > now:
                pinned |= st.hashes
                _note_reuse(reuse, st)
                valid_before = min(valid_before, st.deadline)
        for st in self.retains.values():
            if st.deadline > now:
                for h in st.hashes:
                    if retained.get(h, -(10**9)) < st.priority:
                        retained[h] = st.priority
                _note_reuse(reuse, st)
                valid_before = min(valid_before, st.deadline)
        result = (pinned, retained, reuse)
        self._protection_cache = (now, valid_before, result)
        return result

    def host_order(self, blocks: list[int]) -> list[int]:
        """The host tier's eviction order when it honours retention (`HostTier.order`; the
        engine's opt-in `engine_integration.tiers.host_policy`, kvhint.v1 TierInfo.honours_retention):
        the host's blocks (least recently used first) in the order the tier drops them.
        Unprotected blocks (LRU), then protected blocks the device still holds (LRU), then
        retained blocks by priority and furthest expected reuse (passed: LRU), pinned last."""
        now = self.now
        pinned, retained, reuse = self._protection()
        keyed: list[tuple[tuple[Any, ...], int]] = []
        for pos, h in enumerate(blocks):
            if h not in pinned and h not in retained:
                key: tuple[Any, ...] = (0, 0, 0, 0.0, pos)
            elif self.pool.resident(h):
                key = (1, 0, 0, 0.0, pos)
            else:
                order = _reuse_order(reuse.get(h), now)
                key = (3, 0, *order, pos) if h in pinned else (2, retained[h], *order, pos)
            keyed.append((key, h))
        keyed.sort(key=lambda kh: kh[0])
        return [h for _, h in keyed]

    def choose(self, pool: BlockPoolModel, n: int, req: BlockRequest) -> list[int]:
        """The `n` free blocks to evict: by class (unhashed, released, ordinary, retained,
        pinned), LRU (free-list position) within the first three, and by priority then
        `_reuse_order` then position within the protected two."""
        now = self.now
        pinned, retained, reuse = self._protection()
        rel, demoted, owners_of, block_hash = self.released, self.demoted, self.owners, pool.block_hash
        gone = rel or demoted  # else no session is released or demoted: no owner check
        unhashed: list[int] = []
        released: list[int] = []
        ordinary: list[int] = []
        protected: list[tuple[tuple[Any, ...], int]] = []
        for pos, b in enumerate(pool.free):
            h = block_hash[b]
            if h is None:
                unhashed.append(b)
                if len(unhashed) == n:  # the first n in LRU order go before anything else
                    break
            elif h in pinned or h in retained:
                cls = (self.T_PINNED, 0) if h in pinned else (self.T_RETAINED, retained[h])
                protected.append(((*cls, *_reuse_order(reuse.get(h), now), pos), b))
            else:
                owners = owners_of.get(h) if gone else None
                if owners and all(o in rel or o in demoted for o in owners):
                    released.append(b)
                else:
                    ordinary.append(b)
        chosen = (unhashed + released + ordinary)[:n]
        if len(chosen) < n:
            protected.sort(key=lambda kb: kb[0])
            taken = protected[: n - len(chosen)]
            self.stats["pins_broken"] += sum(1 for k, _ in taken if k[0] == self.T_PINNED)
            chosen += [b for _, b in taken]
        return chosen

    def run_request(self, req: BlockRequest) -> tuple[int, int]:
        self.now = max(self.now, req.t)
        res = _run_request(self.pool, req, self.choose, self.host)
        self.note_running(req)
        return res

    def note_running(self, req: BlockRequest) -> None:
        """`req` ran (or was admitted): its session is live again and owns its chain."""
        self.released.discard(req.session_id)  # a session that runs again is live
        self.demoted.discard(req.session_id)
        self.chain_of[req.session_id] = req.chain
        for h in req.chain:
            self.owners.setdefault(h, set()).add(req.session_id)


def _reuse_at(a: Pin | Retain, t: float) -> float | None:
    return None if a.expected_reuse_in_s is None else t + min(a.expected_reuse_in_s, a.ttl_s)


def _reuse_order(at: float | None, now: float) -> tuple[int, float]:
    """Order within one (class, priority): no or a passed expectation first (LRU among them, by
    the caller's position), then the furthest expected reuse first."""
    return (0, 0.0) if at is None or at <= now else (1, -at)


def _note_reuse(reuse: dict[int, float], st: _HintState) -> None:
    if st.reuse_at is None:
        return
    for h in st.hashes:
        if st.reuse_at < reuse.get(h, math.inf):
            reuse[h] = st.reuse_at


class _NoHints:
    """A policy that sends nothing (the unhinted tier run)."""

    def start(self, t: float) -> list[Action]:
        return []

    def observe(self, sig: Signal) -> list[Action]:
        return []


def drive_policy(hp: HintedPool, pol: ReferencePolicy | LibraryPolicy | _NoHints, name: str) -> SimResult:
    """Run the trace through `hp`, applying the policy's actions when it emits them."""
    bt = hp.bt
    t0 = bt.items[0].t if bt.items else 0.0
    for a in pol.start(t0):
        hp.apply(a, t0)
    sees_requests = isinstance(pol, LibraryPolicy)
    cached: list[int] = []
    peak = 0
    done: list[tuple[float, int, str]] = []  # (completion, index, session) of requests run

    def completions(until: float) -> None:
        # The library policy hears of a completion before a signal or request at the same time
        # (its hints go out with that item's flush).
        while done and done[0][0] <= until:
            t, _, sid = heapq.heappop(done)
            pol.completed(sid, t)  # type: ignore[union-attr]

    for item in bt.items:
        if sees_requests:
            completions(item.t)
        if isinstance(item, BlockRequest):
            if sees_requests:
                for a in pol.request(item.session_id, item.t):
                    hp.apply(a, item.t)
            nhit, inuse = hp.run_request(item)
            if sees_requests:
                heapq.heappush(done, (item.t_done, item.index, item.session_id))
            cached.append(nhit * bt.block_size)
            peak = max(peak, inuse)
        else:
            for a in pol.observe(item):
                hp.apply(a, item.t)
    if sees_requests:
        completions(math.inf)
    stats = dict(hp.stats)
    if sees_requests:
        stats["hints_sent"] = pol.policy.stats.get("sent", 0)
    if hp.host is not None:
        stats["host_loaded_tokens"] = hp.host.loaded_blocks * bt.block_size
    return SimResult(name, cached, bt.prompt_tokens, peak, hp.pool.evictions, stats)


def simulate_hinted(
    bt: BlockTrace,
    policy_config: PolicyConfig | None = None,
    *,
    num_gpu_blocks: int | None = None,
    pin_budget_fraction: float = 0.5,
    name: str = "hinted",
) -> SimResult:
    """Hint-aware pool driven by `bench.policy.ReferencePolicy` (causal)."""
    cfg = policy_config or bt.policy_config
    hp = HintedPool(bt, num_gpu_blocks, pin_budget_fraction)
    return drive_policy(hp, ReferencePolicy(cfg, bt.shared_prefix_target), name)


def simulate_library(
    bt: BlockTrace,
    config: Any = None,
    *,
    num_gpu_blocks: int | None = None,
    pin_budget_fraction: float = 0.5,
    name: str = "policy",
    clairvoyant: bool = False,
    pause_state: Mapping[str, Any] | None = None,
) -> SimResult:
    """Hint-aware pool driven by `bench.policy.LibraryPolicy` (`kvhint_client.policy`).
    `config`: a `kvhint_client.policy.PolicyConfig` (default: `library_config` of the trace).
    `clairvoyant`: predict every pause by its true end (a diagnostic upper bound for the
    predictions, `bench.policy.ClairvoyantSessionPolicy`). `pause_state`: the policy's pause
    model starts from it (`learned_pause_state` of another trace: a warm start)."""
    hp = HintedPool(bt, num_gpu_blocks, pin_budget_fraction)
    starts = _session_starts(bt) if clairvoyant else None
    pol = LibraryPolicy(config or bt.library_config, bt.shared_prefix_target, starts, pause_state)
    return drive_policy(hp, pol, name)


def learned_pause_state(bt: BlockTrace, config: Any = None) -> dict[str, Any]:
    """What the library policy's pause model has learned after running over the whole of `bt`
    (`PauseModel.export()`): the state a router that served this traffic carries into the next.
    The model learns from the signals and requests alone, so the pool it runs against does
    not change it."""
    pol = LibraryPolicy(config or bt.library_config, bt.shared_prefix_target)
    drive_policy(HintedPool(bt, None, 0.5), pol, "training")
    return pol.policy.model.export()


def _session_starts(bt: BlockTrace) -> dict[str, list[float]]:
    """Each session's request start times (the clairvoyant policy's true resume times)."""
    starts: dict[str, list[float]] = {}
    for r in bt.requests:
        starts.setdefault(r.session_id, []).append(r.t)
    return starts


def simulate_tiers(
    bt: BlockTrace,
    policy: str = "none",
    *,
    host_blocks: int | None = None,
    num_gpu_blocks: int | None = None,
    pin_budget_fraction: float = 0.5,
    name: str | None = None,
    pause_state: Mapping[str, Any] | None = None,
    clairvoyant: bool = False,
    host_retention: bool = False,
) -> SimResult:
    """The device pool plus a `HostTier` of `host_blocks` (default: as many as the device
    pool's usable blocks). `policy`: ``none`` (vLLM's offloading alone, run f),
    ``reference`` (the earlier reference policy's ``hints+tiers`` variant, run g) or
    ``library`` (`LibraryPolicy` with ``use_tiers``: Demote on a predicted long pause,
    Prefetch before the predicted resume; `pause_state` and `clairvoyant` as in
    `simulate_library`). The host tier drops blocks in LRU order, as vLLM's own host policy
    (the engine's default) does; with `host_retention`, in `HintedPool.host_order`, as the
    engine's opt-in host policy does (`--kvhint-tiers ...,host-eviction=kvhint`)."""
    if (pause_state is not None or clairvoyant) and policy != "library":
        raise ValueError("pause_state and clairvoyant are for the library policy")
    n = num_gpu_blocks or bt.num_gpu_blocks
    host = HostTier(host_blocks if host_blocks is not None else n - 1)
    hp = HintedPool(bt, n, pin_budget_fraction, host)
    if host_retention:
        host.order = hp.host_order
    pol: ReferencePolicy | LibraryPolicy | _NoHints
    if policy == "none":
        pol = _NoHints()
    elif policy == "reference":
        pol = ReferencePolicy(policy_variant("hints+tiers", bt.policy_config), bt.shared_prefix_target)
    elif policy == "library":
        pol = LibraryPolicy(replace(bt.library_config, use_tiers=True), bt.shared_prefix_target,
                            _session_starts(bt) if clairvoyant else None, pause_state)
    else:
        raise ValueError(f"unknown tier policy {policy!r}")
    return drive_policy(hp, pol, name or f"tiers+{policy}")


# --------------------------------------------------------------------------- analysis


def peak_live_blocks(bt: BlockTrace) -> int:
    """Peak over time of distinct block ids in live sessions' latest chains.

    A session is live from its first request until its ``session_ended``
    signal (or the end of the trace); its chain is its latest request's
    prompt + cached decode blocks. This is the working set a cache would need
    to serve every resumption from cache.
    """
    count: dict[int, int] = {}
    chain_of: dict[str, tuple[int, ...]] = {}
    peak = 0

    def drop(chain: tuple[int, ...]) -> None:
        for h in chain:
            c = count[h] - 1
            if c:
                count[h] = c
            else:
                del count[h]

    for item in bt.items:
        if isinstance(item, BlockRequest):
            old = chain_of.get(item.session_id)
            for h in item.chain:
                count[h] = count.get(h, 0) + 1
            if old is not None:
                drop(old)
            chain_of[item.session_id] = item.chain
            peak = max(peak, len(count))
        elif item.kind == "session_ended":
            old = chain_of.pop(item.session_id, None)
            if old is not None:
                drop(old)
    return peak


RUN_LABELS = {
    "lru": "(a) LRU",
    "hints": "(b0) reference policy, no Release",
    "hints+release": "(b) reference policy + Release",
    "policy": "(c) kvhint_client.policy",
    "policy+warm": "(c) kvhint_client.policy, warm start",
    "belady": "(d) Belady-MIN (offline)",
    "infinite": "(e) infinite cache (offline)",
    "tiers+none": "(f) host tier = device pool, no hints",
    "tiers+reference": "(g0) host tier, reference policy + tiers",
    "tiers+library": "(g) host tier, kvhint_client.policy + tiers",
    "tiers+library+warm": "(g) host tier, kvhint_client.policy + tiers, warm start",
}
DEVICE_RUNS = ("lru", "hints", "hints+release", "policy", "policy+warm", "belady")


@dataclass
class Analysis:
    results: dict[str, SimResult]
    num_gpu_blocks: int
    peak_live_blocks: int

    @property
    def belady_over_lru(self) -> float:
        lru = self.results["lru"].recomputed_tokens
        return self.results["belady"].recomputed_tokens / lru if lru else 1.0

    def share_of_belady(self, name: str) -> float:
        """Share of Belady's savings over LRU that run `name` captures (recomputed tokens)."""
        lru = self.results["lru"].recomputed_tokens
        headroom = lru - self.results["belady"].recomputed_tokens
        return (lru - self.results[name].recomputed_tokens) / headroom if headroom > 0 else math.nan

    def vs_infinite(self, name: str) -> float:
        inf = self.results["infinite"].recomputed_tokens
        return self.results[name].recomputed_tokens / inf if inf else math.nan

    def table(self) -> str:
        lru = self.results["lru"].recomputed_tokens or 1
        lines = [
            f"pool {self.num_gpu_blocks} blocks (usable {self.num_gpu_blocks - 1}),"
            f" peak live set {self.peak_live_blocks} blocks,"
            f" prompt tokens {self.results['lru'].prompt_tokens}",
            f"{'run':<46}{'hit rate':>9}{'recomputed':>12}{'x LRU':>7}{'x inf':>7}{'of Belady':>10}",
        ]
        for name, r in self.results.items():
            share = self.share_of_belady(name) if name in DEVICE_RUNS else math.nan
            lines.append(
                f"{RUN_LABELS.get(name, name):<46}{r.hit_rate:>9.3f}{r.recomputed_tokens:>12d}"
                f"{r.recomputed_tokens / lru:>7.3f}{self.vs_infinite(name):>7.2f}"
                + (f"{share:>10.2f}" if not math.isnan(share) else f"{'':>10}")
            )
        lines.append(f"Belady/LRU recomputation ratio: {self.belady_over_lru:.3f}")
        lines.append("'of Belady': share of Belady's savings over LRU (device-only runs); 'x inf': recomputed / infinite cache.")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "num_gpu_blocks": self.num_gpu_blocks,
            "peak_live_blocks": self.peak_live_blocks,
            "belady_over_lru": round(self.belady_over_lru, 4),
            "results": {k: v.summary() for k, v in self.results.items()},
        }


def analyze(
    trace: Trace | BlockTrace,
    *,
    num_gpu_blocks: int | None = None,
    pin_budget_fraction: float = 0.5,
    policy_config: PolicyConfig | None = None,
    async_scheduling: bool = False,
    tiers: bool = False,
) -> Analysis:
    """Run LRU, hints (run b), hints+release (run c), the library policy, Belady and infinite;
    with `tiers`, also the tier runs on a host tier as large as the device pool: unhinted (f),
    the reference policy (g) and the library policy (`simulate_tiers`)."""
    bt = trace if isinstance(trace, BlockTrace) else compile_trace(trace, async_scheduling=async_scheduling)
    n = num_gpu_blocks or bt.num_gpu_blocks
    if n < 2:
        raise ValueError("trace header has no num_gpu_blocks; pass num_gpu_blocks (pool size incl. the null block)")
    base = policy_config or bt.policy_config
    results = {
        "lru": simulate_lru(bt, n),
        "hints": simulate_hinted(
            bt, policy_variant("hints", base), num_gpu_blocks=n, pin_budget_fraction=pin_budget_fraction, name="hints"
        ),
        "hints+release": simulate_hinted(
            bt,
            policy_variant("hints+release", base),
            num_gpu_blocks=n,
            pin_budget_fraction=pin_budget_fraction,
            name="hints+release",
        ),
        "policy": simulate_library(bt, num_gpu_blocks=n, pin_budget_fraction=pin_budget_fraction),
        "belady": simulate_belady(bt, n),
        "infinite": simulate_infinite(bt),
    }
    if tiers:
        for policy in ("none", "reference", "library"):
            r = simulate_tiers(bt, policy, num_gpu_blocks=n, pin_budget_fraction=pin_budget_fraction)
            results[r.name] = r
    return Analysis(results, n, peak_live_blocks(bt))
