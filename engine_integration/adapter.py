"""VllmAdapter: the EngineAdapter for vLLM 0.32, running inside EngineCore.

Block hashes on the wire are vLLM's *external* hashes, exactly as vLLM's own
KV events publish them: with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1 (vLLM's
default) the 64-bit integer `int.from_bytes(digest, "big") & (2**64 - 1)`,
sent as its 8-byte big-endian encoding (= the digest's last 8 bytes);
otherwise the raw digest.

Every KV-cache group is tracked (see kv_groups): the index stays logical (one
node per BlockHash), a logical block resolves to its copies in every group,
and hints act on all of them. A block is reported resident (BlocksStored /
BlocksRemoved, QueryResidency) while every residency group (the
full-attention groups) holds a copy; copies in sliding-window groups are the
window tails a hit also reads, protected and evicted with their block. Only
the residency groups' copies are booked: the other groups store the same
positions in the same vLLM call (or their logical block is resident already),
so their stores and removals change nothing KvHint reports.

Thread model: everything here runs on the engine thread, except `info()`,
`request_wakeup()` and the `_book_*` steps. The residency hooks (`on_*`) read
what vLLM may change later and hand the rest to `KvHintCore.record` as a
`_book_*` step: run at once (inline bookkeeping), or journaled and run in
order on the sidecar's settler thread under the journal's lock (deferred;
kvhint_server/journal.py). The state those steps change (`_digest`,
`_resident`, the core's index and events) is read by the engine thread only
inside `KvHintCore.exclusive()` sections (hints, queries, snapshots), which
settle the journal first, or while nothing is deferred (tiers attached). One
exception: retention expiry re-files an expired grant's blocks through
`_digest`. Such a block stayed resident from its grant (an exclusive section,
so its entry was settled) to its expiry (a removal ends the grant, or, with a
host tier that honours retention, leaves it on a block with no device copy to
re-file), so its entry is there when it matters. The retention ledger is the
engine thread's alone: the hooks end a removed block's grants themselves
(`KvHintCore.end_device_grants`), and no `_book_*` step touches the ledger.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import vllm
from vllm import envs
from vllm.v1.core.kv_cache_utils import get_block_hash, resolve_block_hashes

from kvhint_server.adapter import EvictReport, TierRefusal, TierTask
from kvhint_server.core import KvHintCore
from kvhint_server.model import (
    Action,
    ActionSupport,
    BlockState,
    EngineInfo,
    Reason,
    RemovalCause,
    RetentionClass,
    RetentionView,
    SelectorKind,
    Tier,
    TierInfo,
)

from . import vllm_private
from .coords import request_coords
from .dp import dp_rank_and_size
from .kv_groups import GroupLayout, layout_of

log = logging.getLogger("kvhint.vllm")

ALL_SELECTORS = (SelectorKind.SESSION, SelectorKind.CONTINUATION, SelectorKind.BLOCK_HASHES)
MEDIUM_TIER = {"GPU": Tier.DEVICE, "CPU": Tier.HOST, "STORAGE": Tier.DISK}


def device_actions() -> tuple[ActionSupport, ...]:
    """Actions of an engine without lower tiers."""
    local = tuple(
        ActionSupport(a, True, ALL_SELECTORS, supports_range=True, supports_expected_reuse=a in (Action.RETAIN, Action.PIN))
        for a in (Action.RETAIN, Action.PIN, Action.RELEASE, Action.EVICT)
    )
    remote = tuple(
        ActionSupport(a, False, notes="no lower KV tier configured (start the engine with tiers enabled)")
        for a in (Action.DEMOTE, Action.PREFETCH, Action.SHARE)
    )
    return local + remote


class VllmAdapter:
    def __init__(self, core: KvHintCore, scheduler: Any, engine_core: Any | None) -> None:
        self.core = core
        self.scheduler = scheduler
        self.pool: Any = None  # KvHintBlockPool, set by attach_pool
        self._engine_core = engine_core
        self._int_hashes = bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
        # A pool key (digest + 4-byte group id) sliced to its external hash: `external(key[:-4])`.
        self._key_to_external = slice(-12, -4) if self._int_hashes else slice(None, -4)
        # Wire hash -> vLLM BlockHash (digest) of every block with a cached copy
        # in a residency group (int hashes only; otherwise the wire hash is the
        # digest). Copies in the other groups are found through it (`_copies`).
        self._digest: dict[bytes, bytes] = {}
        # Wire hashes reported resident (BlocksStored, not yet BlocksRemoved).
        self._resident: set[bytes] = set()
        self.groups: GroupLayout = layout_of(None)
        self._residency_suffixes: frozenset[bytes] = frozenset()
        self._cacheable_suffixes: tuple[bytes, ...] = ((0).to_bytes(4, "big"),)
        # Per residency-group suffix, the other residency groups' suffixes.
        self._other_residency: dict[bytes, tuple[bytes, ...]] = {}
        self._wake_pending = False
        self._wake_lock = threading.Lock()
        self._max_id = core.config.max_id_length
        self.tiers: Any = None  # engine_integration.tiers.runtime.TierRuntime when tiers are enabled
        # Engine thread: the last local prefix lookup of this step, (request, hit tokens), not
        # booked yet (hooks.KvHintKVCacheManager.get_computed_blocks). Booked when the request
        # takes the blocks (on_blocks_cached, on_lookup_taken); overwritten by the next lookup;
        # dropped at the end of every schedule() (KvHintScheduler.schedule), so a request that
        # is never admitted (memory pressure, then aborted) leaves nothing behind.
        self.pending_hit: tuple[Any, int] | None = None
        # Engine thread: pool keys the allocation fast path removed (hooks.KvHintBlockPool.
        # get_new_blocks, cause EVICTED), in vLLM's order, not reported yet. The pool appends to
        # this list in its loop; `flush_removed` reports them in one call before anything else
        # is reported or booked, before a store, and at each step boundary (KvHintScheduler),
        # so events keep vLLM's order and every engine-thread task sees them booked. Off with
        # lower tiers attached (`attach_tiers`): their runtime books its own changes inline.
        self._carried: list[bytes] = []

    def attach_pool(self, pool: Any) -> None:
        self.pool = pool
        self.groups = layout_of(getattr(self.scheduler, "kv_cache_config", None))
        self._residency_suffixes = frozenset(g.to_bytes(4, "big") for g in self.groups.residency)
        # Pool-key suffixes of every cacheable group (vLLM's make_block_hash_with_group_id:
        # digest + 4-byte big-endian group id), precomputed for the per-block paths.
        self._cacheable_suffixes = tuple(g.to_bytes(4, "big") for g in self.groups.cacheable)
        self._other_residency = {s: tuple(o for o in self._residency_suffixes if o != s) for s in self._residency_suffixes}
        # Fixed for the engine's life; read by the per-call hooks below.
        self._multi_residency = len(self.groups.residency) > 1
        # Every cacheable group is a residency group (a dense model): a popped key needs no
        # group check before its grants are dropped.
        self._all_resident = set(self.groups.cacheable) <= set(self.groups.residency)
        self._hash_block_size = pool.hash_block_size
        pool._kvh_unbooked = frozenset(self.groups.cacheable) - frozenset(self.groups.residency)
        self._bind_carry()

    def attach_tiers(self, tiers: Any) -> None:
        """Lower KV tiers (a TierRuntime, or None): with them, the pool reports each allocation's
        removals at once instead of carrying them (`flush_removed`)."""
        self.flush_removed()
        self.tiers = tiers
        if self.pool is not None:
            self._bind_carry()

    def _bind_carry(self) -> None:
        """The pool's fast path carries into `_carried` unless lower tiers are attached."""
        self.pool._kvh_carry = self._carried if self.tiers is None else None

    # ------------------------------------------------------------ hashes

    def external(self, block_hash: bytes) -> bytes:
        return block_hash[-8:] if self._int_hashes else block_hash

    def _digest_of(self, ext: bytes) -> bytes | None:
        return self._digest.get(ext) if self._int_hashes else ext

    def _key(self, ext: bytes) -> bytes | None:
        """The pool key of `ext` in the first residency group (None when unknown)."""
        digest = self._digest_of(ext)
        return None if digest is None else self.groups.keys(digest, self.groups.residency[:1])[0]

    def _copies(self, ext: bytes) -> list[Any]:
        """Every cached copy of a logical block, in every group."""
        digest = self._digest_of(ext)
        return [] if digest is None else self._copies_of_digest(digest, vllm_private.cached_block_map(self.pool))

    def _copies_of_digest(self, digest: bytes, cache: dict[Any, Any]) -> list[Any]:
        """Every copy `cache` (the pool's map) holds of the block with vLLM digest `digest`."""
        out: list[Any] = []
        for suffix in self._cacheable_suffixes:
            out.extend(vllm_private.copies_in(cache.get(digest + suffix)))
        return out

    def _held_by_all(self, digest: bytes, groups: tuple[int, ...]) -> bool:
        cache = vllm_private.cached_block_map(self.pool)
        return all(key in cache for key in self.groups.keys(digest, groups))

    # For the tier runtime (engine thread).

    def device_digest(self, ext: bytes) -> bytes | None:
        """vLLM's block hash (digest) of a logical block the device pool holds a
        copy of, in any group; None when it holds none."""
        digest = self._digest_of(ext)
        return digest if digest is not None and self._copies(ext) else None

    def device_resident(self, ext: bytes) -> bool:
        """The device pool holds the logical block (reported resident: BlocksStored, not yet removed)."""
        return ext in self._resident

    def device_copies(self, ext: bytes) -> list[Any]:
        """Every device copy of a logical block, in every KV-cache group."""
        return self._copies(ext)

    # ------------------------------------------------------------ EngineAdapter: static

    def info(self) -> EngineInfo:
        cache_config = self.scheduler.cache_config
        tiers: tuple[TierInfo, ...] = (TierInfo(Tier.DEVICE, self.pool.medium, self.pool.num_gpu_blocks),)
        actions = device_actions()
        destinations: tuple[str, ...] = ()
        if self.tiers is not None:
            tiers += self.tiers.tier_infos()
            actions = self.tiers.actions(actions)
            destinations = self.tiers.share_destinations()
        dp_rank, dp_size = dp_rank_and_size(self.scheduler.vllm_config)
        return EngineInfo(
            engine="vllm",
            engine_version=vllm.__version__,
            block_size=self.scheduler.block_size,
            num_device_blocks=self.pool.num_gpu_blocks,
            block_hash_encoding="int64" if self._int_hashes else cache_config.prefix_caching_hash_algo,
            tiers=tiers,
            actions=actions,
            share_destinations=destinations,
            kv_cache_groups=self.groups.infos,
            data_parallel_rank=dp_rank,
            data_parallel_size=dp_size,
        )

    def request_wakeup(self) -> None:
        """Wake an idle EngineCore so it runs `core.run_pending()` now.

        Busy engines run it at the next `schedule()`. Idle ones sit in
        `input_queue.get()`; a WAKEUP message returns them to the idle loop,
        which runs idle callbacks on the engine thread (vllm_private.add_idle_callback).
        """
        engine = self._engine_core
        if not vllm_private.has_idle_loop(engine):
            return  # in-process engine without a busy loop: next step() applies
        with self._wake_lock:
            if self._wake_pending:
                return
            self._wake_pending = True
        vllm_private.add_idle_callback(engine, self._on_idle)

    def _on_idle(self, _engine: Any) -> None:
        with self._wake_lock:
            self._wake_pending = False
        self.core.run_pending()

    # ------------------------------------------------------------ EngineAdapter: engine thread

    def lookup(self, hashes: Sequence[bytes]) -> dict[bytes, BlockState]:
        out: dict[bytes, BlockState] = {}
        for h in hashes:
            copies = self._copies(h)
            mask = Tier.DEVICE.bit if h in self._resident else 0
            if self.tiers is not None:
                mask |= self.tiers.lower_tiers_of(h)
            if mask:
                out[h] = BlockState(h, mask, in_use=any(b.ref_cnt > 0 for b in copies))
        return out

    def device_groups(self, hashes: Sequence[bytes]) -> dict[bytes, int]:
        cache, out = vllm_private.cached_block_map(self.pool), {}
        pairs = tuple(zip(self.groups.cacheable, self._cacheable_suffixes))
        for h in hashes:
            digest = self._digest_of(h)
            if digest is None:
                continue
            mask = 0
            for group, suffix in pairs:
                if digest + suffix in cache:
                    mask |= 1 << group
            if mask:
                out[h] = mask
        return out

    def device_blocks(self) -> Iterable[BlockState]:
        for ext in list(self._resident):
            yield BlockState(ext, Tier.DEVICE.bit, in_use=any(b.ref_cnt > 0 for b in self._copies(ext)))

    def refile(self, hashes: Iterable[bytes]) -> None:
        """File every free copy of these blocks by its class. `hashes` come tail first (the
        order they should become eviction candidates; a hash listed twice counts at its last
        place), and both destinations keep it: a block that stays protected is filed as the
        most recent of its bucket in this order (one already filed so is filed again), so
        the chain's tail is its bucket's first to go and a hint sent again over a longer
        chain (the next turn's) orders the whole chain tail first; a block that becomes
        ordinary leaves its bucket for the free queue's head, one at a time, so those are
        taken in the reverse order, which leaves the tail at the head."""
        core, refile_block, copies_of = self.core, self.pool.kvh_refile_block, self._copies
        ordinary: list[tuple[list[Any], RetentionView]] = []  # (copies, view), filed last, reversed
        for h in hashes:
            copies = copies_of(h)
            # Only free copies are filed by class (refile_block skips blocks in use),
            # so a block every copy of which is in use needs no retention view.
            if copies and any(b.ref_cnt == 0 for b in copies):
                view = core.retention(h)
                if view.cls is RetentionClass.ORDINARY:
                    ordinary.append((copies, view))
                    continue
                for block in copies:
                    refile_block(block, view, refresh=True)
        for copies, view in reversed(ordinary):
            for block in copies:
                refile_block(block, view, refresh=True)
        self.pool.kvh_sync_mode()  # the retention order on while anything is retained

    def granted_keys(self, keys: list[Any]) -> list[Any]:
        """Engine thread: those of these pool keys whose logical block holds a grant, in order."""
        grants = self.core.ledger.grants
        if not grants:
            return []
        cut = self._key_to_external
        return [key for key in keys if key[cut] in grants]

    def granted_since(self, mark: Any) -> list[tuple[Any, Any]]:
        """Engine thread, right after vLLM's `free_blocks`: the cached blocks it put at the free
        queue's tail since `vllm_private.queue_tail` returned `mark`, oldest first, with their
        pool keys, those only whose logical block holds a grant (what `refile_freed` files)."""
        return vllm_private.appended_since(self.pool, mark, self.core.ledger.grants, self._key_to_external)

    def granted_among(self, blocks: list[Any]) -> list[tuple[Any, Any]]:
        """Engine thread, right after vLLM's `free_blocks(blocks)` when its placement of the freed
        blocks is not the one `granted_since` relies on (vllm_compat): the blocks of `blocks` it
        left free and cached in this pool, in their order, with their pool keys, those only whose
        logical block holds a grant. Public block attributes only."""
        grants, cut, pool = self.core.ledger.grants, self._key_to_external, self.pool
        out, seen = [], set()
        for block in blocks:
            key = block.block_hash
            if block.ref_cnt or block.is_null or key is None or block.block_id in seen:
                continue  # still in use, the null block, uncached, or listed twice
            if key[cut] in grants and getattr(block, "pool", None) in (None, pool):
                seen.add(block.block_id)
                out.append((block, key))
        return out

    def refile_freed(self, freed: list[tuple[Any, Any]]) -> None:
        """Engine thread, after vLLM freed blocks with a grant in effect: `freed` holds the
        cached ones it put at the free queue's tail whose logical block holds a grant, with
        their pool keys (`granted_since`). Files them by their class. They were in use until
        now, so none is filed as protected yet; a freed block without a grant on its logical
        block stays where vLLM put it (what re-filing it would do, without the retention view)."""
        cut = self._key_to_external
        refile_block = self.pool.kvh_refile_block
        if self._all_resident:  # one copy per block, freed by vLLM tail first: its order
            for block, _key in freed:
                refile_block(block)
            return
        # Several groups: vLLM frees a request's blocks group after group, and frees window
        # copies that leave the window while the request runs (filed then, ahead of the rest).
        # File by logical block instead, the deepest first, each with every free copy it has
        # (those filed earlier again): the chain's tail goes first, a block's copies together,
        # and the window tail a resume at the chain's end reads is not the first victim.
        granted = sorted(freed, key=lambda bk: -(bk[0].block_hash_num_tokens or 0))
        cache, seen = vllm_private.cached_block_map(self.pool), set()
        for _, key in granted:
            digest = key[:-4]
            if digest in seen:
                continue
            seen.add(digest)
            view = self.core.retention(key[cut])
            for block in self._copies_of_digest(digest, cache):
                refile_block(block, view, refresh=True)

    def demote_first(self, hashes: Iterable[bytes]) -> list[bytes]:
        moved = []  # logical blocks
        # Chain order in, so the chain's tail ends up at the queue head.
        for h in hashes:
            free = [b for b in self._copies(h) if b.ref_cnt == 0]
            for block in free:
                self.pool.kvh_to_queue_head(block)
            if free:
                moved.append(h)
        return moved

    def evict(self, hashes: Sequence[bytes]) -> EvictReport:
        evicted, in_use = [], []
        for h in hashes:
            copies = self._copies(h)
            if not copies:
                continue
            if any(b.ref_cnt > 0 for b in copies):
                in_use.append(h)
                continue
            for block in copies:
                self.pool.kvh_evict(block, RemovalCause.EVICT_HINT)
            evicted.append(h)
        return EvictReport(tuple(evicted), tuple(in_use))

    def start_tier_task(self, task: TierTask) -> TierRefusal | None:
        if self.tiers is None:
            return TierRefusal(Reason.UNSUPPORTED, f"{task.hint.action.name} needs a lower KV tier; none is configured")
        return self.tiers.start(task)

    # ------------------------------------------------------------ retention (for the pool)

    def retention_active(self) -> bool:
        return bool(self.core.ledger.grants)

    def retention_of_block(self, block: Any) -> RetentionView:
        key = block.block_hash
        return self.core.retention(self.external(get_block_hash(key)))


    # ------------------------------------------------------------ residency hooks (from the pool)

    def on_blocks_cached(
        self,
        request: Any,
        blocks: list[Any],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        group_id: int,
        block_mask: list[bool] | None,
    ) -> None:
        if group_id not in self.groups.residency:
            # A copy in a group that does not define residency (a sliding-window tail beside
            # full attention): nothing to book. A residency group stores the same positions in
            # the same cache_blocks call, or holds them already, so the logical block and its
            # digest are known through it, and hints reach this copy through the logical block.
            return
        lookup = self.pending_hit
        if lookup is not None and lookup[0] is request:
            # The request's admission (allocate_slots) caches its first blocks: it took the hit
            # blocks its lookup found (as many as it holds cached). Booked before the stored
            # blocks, in the order a lookup-time booking had.
            self.pending_hit = None
            self.on_prefix_hit(request, min(lookup[1], num_cached_blocks * block_size))
        # Engine thread, inside vLLM's cache_blocks: read only what vLLM may change later
        # (the request's block list, the pool map) and book the rest through the core's
        # journal (inline or deferred, in order). It gets a plain function and the span's
        # blocks as arguments, so the entry keeps no object of its own alive until it is
        # settled (kvhint_server/journal.py, "Storage").
        hashes = request.block_hashes
        if block_size != self._hash_block_size:
            hashes = resolve_block_hashes(hashes, self._hash_block_size, block_size)
        held = None
        if self._multi_residency:  # resident once every residency group holds it
            held = [self._held_by_all(hashes[i], self.groups.residency) for i in range(num_cached_blocks, num_full_blocks)]
        self.core.record(VllmAdapter._book_stored, self, request, hashes, None if block_mask is None else list(block_mask),
                         num_cached_blocks, held, *blocks[num_cached_blocks:num_full_blocks])

    def _book_stored(
        self, request: Any, hashes: Any, mask: list[bool] | None, num_cached_blocks: int,
        held: list[bool] | None, *span: Any,
    ) -> None:
        keep = [j for j, block in enumerate(span) if not block.is_null and (mask is None or mask[j])]
        fresh = [hashes[num_cached_blocks + j] for j in keep]
        ext = self.external
        if self._int_hashes:
            self._digest.update((ext(h), h) for h in fresh)
        if held is not None:
            keep = [j for j in keep if held[j]]
        positions = [num_cached_blocks + j for j in keep]
        new = [ext(hashes[i]) for i in positions]
        self._resident.update(new)
        parent = ext(hashes[num_cached_blocks - 1]) if num_cached_blocks > 0 else None
        coords = request_coords(request, self._max_id)
        if coords and parent is not None and coords.session_id and not self._is_member(parent, coords.session_id):
            self._record_hit(hashes, num_cached_blocks, coords)
        # Each run of consecutive chain positions with its own first position and parent: a
        # sliding-window residency group caches only the window tail of a prompt (vLLM's
        # block mask), so the stored blocks need not start at num_cached_blocks.
        self._record_runs(hashes, positions, new, coords, prefix_hit=False)

    def _record_runs(self, hashes: Any, positions: list[int], wire: list[bytes], coords: Any, *, prefix_hit: bool) -> None:
        """`core.on_stored` for the blocks at chain `positions` (ascending; `wire`: their wire
        hashes), one call per run of consecutive positions, each with its first position and
        the block before it as parent. One call when they are consecutive (a dense model)."""
        core, ext, medium = self.core, self.external, self.pool.medium
        start, n = 0, len(positions)
        while start < n:
            end = start + 1
            while end < n and positions[end] == positions[end - 1] + 1:
                end += 1
            first = positions[start]
            core.on_stored(
                wire[start:end],
                first_position=first,
                parent=ext(hashes[first - 1]) if first > 0 else None,
                tier=Tier.DEVICE,
                medium=medium,
                coords=coords,
                prefix_hit=prefix_hit,
            )
            start = end

    def on_lookup_taken(self, request: Any, num_hit_tokens: int) -> None:
        """Engine thread: vLLM admitted `request` with `num_hit_tokens` local prefix-hit tokens
        (KVCacheManager.record_prefix_cache_stats). Books the noted lookup's hit unless the
        admission's first cached blocks booked it already (on_blocks_cached)."""
        lookup, self.pending_hit = self.pending_hit, None
        if lookup is not None and lookup[0] is request:
            self.on_prefix_hit(request, num_hit_tokens)

    def on_prefix_hit(self, request: Any, num_computed_tokens: int) -> None:
        n = num_computed_tokens // self.scheduler.block_size
        if n <= 0:
            return
        if self._carried:
            self.flush_removed()
        hashes = request.block_hashes
        if self.scheduler.block_size != self._hash_block_size:
            hashes = resolve_block_hashes(hashes, self._hash_block_size, self.scheduler.block_size)
        self.core.record(VllmAdapter._book_hit, self, request, hashes, n)

    def _book_hit(self, request: Any, hashes: Any, n: int) -> None:
        coords = request_coords(request, self._max_id)
        if not coords:
            return
        # A session already a member of the hit's last block joins nothing new, unless the request
        # names a continuation: the hit is where that continuation lies (as for a request without
        # a session), and a request that stores no full block of its own records it nowhere else.
        if coords.session_id and not coords.continuation_id and self._is_member(self.external(hashes[n - 1]), coords.session_id):
            return
        self._record_hit(hashes, n, coords)

    def _record_hit(self, hashes: Any, n: int, coords: Any) -> None:
        """A request with `coords` read the first `n` blocks of `hashes` from the cache: it joins
        the ones the device holds. Not every hit position is held: on a model whose residency
        group slides (every layer sliding-window), a hit reads only the window's tail, and the
        blocks before it may have been evicted. So only blocks reported resident (`_resident`,
        booked in the same order as this step) are recorded, as runs of consecutive positions;
        recording the rest booked blocks the pool does not hold as resident for good (more
        resident blocks reported than the pool has: tests/inproc/test_window_only.py,
        tests/engine/test_engine_window.py). With a full-attention residency
        group every hit block is resident: one run, the whole prefix."""
        ext, resident = self.external, self._resident
        positions, wire = [], []
        for i in range(n):
            h = ext(hashes[i])
            if h in resident:
                positions.append(i)
                wire.append(h)
        self._record_runs(hashes, positions, wire, coords, prefix_hit=True)

    def _is_member(self, ext: bytes, session: str) -> bool:
        node = self.core.index.node(ext)
        return node is not None and node.has_member(session)

    def flush_removed(self) -> None:
        """Engine thread: report the carried removals (`_carried`) now, as one
        `on_keys_removed` call with cause EVICTED. Cheap when there are none."""
        carried = self._carried
        if carried:
            keys = carried.copy()
            carried.clear()
            self._report_removed(keys, RemovalCause.EVICTED)

    def on_keys_removed(self, keys: list[bytes], cause: RemovalCause) -> None:
        """Hash keys (digest + 4-byte group id) were popped from the pool's map (after the
        carried ones, which are reported first)."""
        if self._carried:
            self.flush_removed()
        self._report_removed(keys, cause)

    def _report_removed(self, keys: list[bytes], cause: RemovalCause) -> None:
        """Hash keys (digest + 4-byte group id) were popped from the pool's map.
        Engine thread: keep the keys of residency groups that left with their group's
        last copy (and, with several residency groups, whether another one still
        holds the logical block), then book the removal through the core's journal.
        Grants on the logical blocks that stopped being resident end here, on the
        engine thread that owns the retention ledger (KvHintCore.end_device_grants:
        retained grants of evicted blocks the host tier holds last when it honours
        retention), whichever thread books the rest."""
        if not self._all_resident:
            # Copies in groups that do not define residency are not booked (on_blocks_cached).
            residency = self._residency_suffixes
            keys = [key for key in keys if key[-4:] in residency]
            if not keys:
                return
        cache = vllm_private.cached_block_map(self.pool)
        # Keep the keys no other copy in the same group still holds (the common case: all).
        popped = keys if cache.keys().isdisjoint(keys) else [key for key in keys if key not in cache]
        if not popped:
            return
        # With int hashes and several residency groups, whether another residency group still
        # holds each logical block (its digest is kept while one does: _book_removed).
        anywhere = None
        if self._int_hashes and self._multi_residency:
            others = self._other_residency
            anywhere = [any(key[:-4] + suffix in cache for suffix in others[key[-4:]]) for key in popped]
        # Only blocks with a grant have grants to end and copies filed as protected (a grant that
        # ends otherwise, by expiry, release or a broken pin, re-files or unprotects its copies
        # there): most evicted blocks hold none, so the rest is skipped for them. (The ledger is
        # read here first so that a report with no grant in effect makes no call.)
        granted = self.granted_keys(popped) if self.core.ledger.grants else None
        if granted:
            tiers = self.tiers  # a host tier that honours retention keeps evicted blocks' retained grants
            lower = tiers.held_for_retention if tiers is not None else None
            cut = self._key_to_external
            self.core.end_device_grants([key[cut] for key in granted], cause, lower)
            self.unprotect_copies([key[:-4] for key in granted])
        # The keys go into the journal entry itself (see on_blocks_cached).
        self.core.record(VllmAdapter._book_removed, self, anywhere, cause, *popped)

    def _book_removed(self, anywhere: list[bool] | None, cause: RemovalCause, *popped: bytes) -> None:
        """Report the logical blocks that stopped being resident: a residency group lost its last copy."""
        resident = self._resident
        ext_of = self.external
        gone = []
        # A key popped twice in one batch (two copies in a group) left with its
        # last copy: report it there, in vLLM's order.
        last = {key: i for i, key in enumerate(popped)}
        for i, key in enumerate(popped):
            if last[key] != i:
                continue
            ext = ext_of(key[:-4])
            if ext in resident:
                resident.discard(ext)
                gone.append(ext)
            if self._int_hashes and (anywhere is None or not anywhere[i]):
                self._digest.pop(ext, None)
        if not gone:
            return
        tiers = self.tiers
        if tiers is None:  # (grants: dropped by on_keys_removed)
            self.core.on_removed(gone, tier=Tier.DEVICE, medium=self.pool.medium, cause=cause, grants_dropped=True)
            return
        tiers.reconcile(gone)  # lower-tier copies the index has not seen yet
        for run, run_cause in tiers.split_removed(gone, cause):  # Demote-reclaimed copies: DEMOTED
            self.core.on_removed(run, tier=Tier.DEVICE, medium=self.pool.medium, cause=run_cause,
                                 remaining_tiers=tiers.residual_tiers, grants_dropped=True)

    def on_pins_broken(self, blocks: list[Any], shortfall: int) -> list[bytes]:
        """Engine thread, in the reclaim before an allocation: the pins of these copies' logical
        blocks end. Returns the blocks' digests: the caller unprotects their other copies after
        the allocation (`unprotect_copies`); at the queue's head before it they would go ahead
        of ordinary blocks the allocation would otherwise take."""
        self.flush_removed()
        # One entry per logical block (a pinned block can have a copy per group).
        digests = list(dict.fromkeys(get_block_hash(b.block_hash) for b in blocks if b.block_hash is not None))
        hashes = [self.external(d) for d in digests]
        log.info("kvhint: breaking %d pinned blocks under memory pressure (shortfall %d)", len(hashes), shortfall)
        sessions = self.core.drop_grants(hashes)  # engine thread: the ledger is its own
        self.core.record(self.core.on_pin_broken, hashes, shortfall, sessions)
        return digests

    def unprotect_copies(self, digests: list[bytes]) -> None:
        """Engine thread: the grants of these logical blocks just ended (their residency copy
        was evicted, or their pin broken). Their free copies that are still filed as protected,
        in any group, go to the free queue's head as ordinary blocks. The retention order takes
        victims one copy at a time, so on a hybrid model it can stop between a block's
        full-attention copy and its sliding-window copy; the copy left behind kept its class
        with no grant behind it (outranking every ordinary block, out of Release's reach,
        broken again as a pin later). Outside vLLM's allocation loop (after it, or before it
        in the reclaim), so the queue may change."""
        pool = self.pool
        protected = pool._kvh_protected
        if not protected.count:
            return
        cache = vllm_private.cached_block_map(pool)
        freed = [block for digest in digests for block in self._copies_of_digest(digest, cache) if protected.remove(block)]
        if freed:
            pool.free_block_queue.prepend_n(freed)

    def on_device_cleared(self) -> None:
        self.flush_removed()
        self.core.clear_grants()  # engine thread, as drop_grants
        self.core.record(self._book_cleared)

    def _book_cleared(self) -> None:
        self._digest.clear()
        self._resident.clear()
        self.core.on_cleared(Tier.DEVICE, grants_dropped=True)
