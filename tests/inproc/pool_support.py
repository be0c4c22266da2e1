"""vLLM's real KVCacheManager/BlockPool in-process, stock or with the KvHint hooks.

No model, no scheduler, no engine process: `Cache` builds the manager the way
vLLM's tests/v1/core/test_prefix_caching.py does (one FullAttentionSpec group),
and drives it with the scheduler's call sequence (get_computed_blocks,
allocate_slots, record_prefix_cache_stats at admission, free). With
`hooked=True` it installs exactly what KvHintScheduler installs
(engine_integration.hooks.install, VllmAdapter, KvHintCore) and applies hints
through the same path as ApplyHints (validation.parse_apply_request ->
HintExecutor.apply_batch), on a clock the test moves.

Observations are what a user of the engine would see: which blocks an
allocation gets, which cached hashes a prefix hit finds, and which hashes
vLLM's own KV events report removed, in order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from google.protobuf import duration_pb2
from hypothesis import strategies as st
from vllm.config import CacheConfig, ParallelConfig, VllmConfig
from vllm.distributed.kv_events import BlockRemoved
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_block_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

from engine_integration.adapter import VllmAdapter
from engine_integration.hooks import KvHintKVCacheManager, install
from engine_integration.inproc import make_request
from kvhint.v1 import kvhint_pb2 as pb
from kvhint_server.config import ServerConfig
from kvhint_server.core import KvHintCore
from kvhint_server.model import HintResult, RetentionClass
from kvhint_server.validation import parse_apply_request

BLOCK_SIZE = 4


class Clock:
    """A monotonic clock that moves only when told to."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Admission:
    """A request admitted into the cache (running until `Cache.free`)."""

    request: Request
    hit_tokens: int
    block_ids: list[int] = field(default_factory=list)


class Cache:
    """One KVCacheManager with `num_blocks` blocks of BLOCK_SIZE tokens (block 0 is vLLM's null block)."""

    def __init__(self, num_blocks: int = 24, *, hooked: bool = True, max_model_len: int = 256, **config: Any) -> None:
        spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32)
        kv_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
        self.manager = (KvHintKVCacheManager if hooked else KVCacheManager)(
            kv_config,
            max_model_len=max_model_len,
            scheduler_block_size=BLOCK_SIZE,
            hash_block_size=BLOCK_SIZE,
            enable_caching=True,
            enable_kv_cache_events=True,
        )
        self.pool = self.manager.block_pool
        self.hooked = hooked
        self.clock = Clock()
        self.removed: list[bytes] = []  # external hashes vLLM's events reported removed, in order
        if hooked:
            self.core = KvHintCore(ServerConfig(address="127.0.0.1:0", **config), monotonic=self.clock)
            # The Scheduler attributes KvHint reads (install, VllmAdapter), real vLLM objects.
            vllm_config = VllmConfig(
                cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True, prefix_caching_hash_algo="sha256"),
                parallel_config=ParallelConfig(),
            )
            scheduler_like = SimpleNamespace(
                kv_cache_manager=self.manager,
                kv_cache_config=kv_config,
                block_size=BLOCK_SIZE,
                cache_config=vllm_config.cache_config,
                vllm_config=vllm_config,
            )
            self.adapter = VllmAdapter(self.core, scheduler_like, None)
            self.adapter.attach_pool(install(scheduler_like, self.adapter))
            self.core.attach(self.adapter)
            self.executor = self.core.executor

    # ------------------------------------------------------------ the scheduler's calls

    def admit(self, request_id: str, tokens: Sequence[int], session: str | None = None) -> Admission | None:
        """Prefix lookup + allocation for the whole prompt, as the scheduler admits a
        request; None when the pool cannot hold it (nothing changes then)."""
        request = make_request(request_id, tokens, session_id=session, max_tokens=64, block_size=BLOCK_SIZE)
        computed, hit_tokens = self.manager.get_computed_blocks(request)[:2]
        blocks = self.manager.allocate_slots(request, len(tokens) - hit_tokens, hit_tokens, computed)
        if blocks is None:
            return None
        # vLLM's scheduler records the admitted request's local hit (where KvHint books it).
        self.manager.record_prefix_cache_stats(request, hit_tokens)
        request.num_computed_tokens = len(tokens)
        return Admission(request, hit_tokens, self.block_ids(request))

    def decode(self, admission: Admission, token: int) -> bool:
        """One sampled token appended and its slot allocated (a decode step)."""
        request = admission.request
        request.append_output_token_ids(token)
        if self.manager.allocate_slots(request, 1) is None:
            return False
        request.num_computed_tokens += 1
        admission.block_ids = self.block_ids(request)
        return True

    def free(self, admission: Admission) -> None:
        self.manager.free(admission.request)

    def run(self, request_id: str, tokens: Sequence[int], session: str | None = None) -> Admission:
        """Admit and finish a request (its blocks become free cached blocks)."""
        admission = self.admit(request_id, tokens, session)
        assert admission is not None, f"{request_id}: no room for {len(tokens)} tokens"
        self.free(admission)
        return admission

    def block_ids(self, request: Request) -> list[int]:
        return list(self.manager.get_block_ids(request.request_id)[0])

    def allocate(self, n: int) -> list[int]:
        """Take `n` new blocks straight from the pool (memory pressure); returns their ids."""
        return [b.block_id for b in self.pool.get_new_blocks(n)]

    # ------------------------------------------------------------ observations

    def boundary(self) -> None:
        """A step boundary, where KvHintScheduler reports the allocations' carried removals
        (VllmAdapter.flush_removed); the hooked cache's observations and hints come after one."""
        if self.hooked:
            self.adapter.flush_removed()

    def take_removed(self) -> list[bytes]:
        """External hashes removed since the last call, in vLLM's event order (at a step
        boundary: KvHint's reports of them are in too)."""
        self.boundary()
        for event in self.pool.take_events():
            if isinstance(event, BlockRemoved):
                self.removed.extend(_external(h) for h in event.block_hashes)
        out, self.removed = self.removed, []
        return out

    def free_queue(self) -> list[int]:
        """Block ids in vLLM's free queue, head (next evicted) first."""
        return [b.block_id for b in self.pool.free_block_queue.get_all_free_blocks()]

    def cached(self) -> dict[bytes, list[int]]:
        """Cached hash key -> block ids holding it."""
        out = {}
        for key, entry in self.pool.cached_block_hash_to_block._cache.items():
            out[key] = sorted(entry) if isinstance(entry, dict) else [entry.block_id]
        return out

    def chain(self, admission: Admission) -> list[bytes]:
        """External hashes of the request's full blocks, in chain order."""
        return [_external(h) for h in admission.request.block_hashes]

    def is_cached(self, h: bytes) -> bool:
        return any(_external(get_block_hash(key)) == h for key in self.pool.cached_block_hash_to_block._cache)

    def filed(self) -> dict[int, tuple[RetentionClass, int]]:
        """Free blocks the hooks keep outside the queue: block id -> (class, priority)."""
        protected = self.pool._kvh_protected
        return {b.block_id: protected.filed_as(b) for b in protected.blocks()}

    # ------------------------------------------------------------ hints (the ApplyHints path)

    def apply(self, *hints: pb.Hint) -> list[HintResult]:
        """Validate and apply a batch on this (the engine) thread, as ApplyHints does."""
        self.boundary()  # hints apply at a step boundary
        parsed = parse_apply_request(pb.ApplyHintsRequest(hints=list(hints)), self.core.config, self.core.info)
        results = self.executor.apply_batch(parsed).results
        return results


def _external(block_hash: Any) -> bytes:
    """The wire form (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, vLLM's default): 8 bytes big-endian."""
    if isinstance(block_hash, int):
        return block_hash.to_bytes(8, "big")
    return bytes(block_hash)[-8:]


# ---------------------------------------------------------------- hint builders


def session(session_id: str) -> pb.Selector:
    return pb.Selector(session=pb.SessionSelector(session_id=session_id))


def hashes(block_hashes: Iterable[bytes]) -> pb.Selector:
    return pb.Selector(block_hashes=pb.BlockHashSelector(block_hashes=list(block_hashes)))


def _ttl(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d


def retain(selector: pb.Selector, ttl_s: float = 60.0, priority: int = 0) -> pb.Hint:
    return pb.Hint(selector=selector, retain=pb.RetainAction(priority=priority, ttl=_ttl(ttl_s)))


def pin(selector: pb.Selector, ttl_s: float = 60.0) -> pb.Hint:
    return pb.Hint(selector=selector, pin=pb.PinAction(ttl=_ttl(ttl_s)))


def release(selector: pb.Selector) -> pb.Hint:
    return pb.Hint(selector=selector, release=pb.ReleaseAction())


def evict(selector: pb.Selector) -> pb.Hint:
    return pb.Hint(selector=selector, evict=pb.EvictAction())


def tokens(seed: int, n: int) -> list[int]:
    """`n` prompt tokens unique to `seed` (distinct seeds share no block)."""
    return [1000 * (seed + 1) + i for i in range(n)]


# The traffic operations `traffic_step` runs, as Hypothesis strategies (each random-traffic test
# adds its own pressure, hints and other operations).
SESSIONS = ["a", "b", "c"]
admit = st.tuples(st.just("admit"), st.integers(0, 2), st.integers(1, 3), st.integers(0, BLOCK_SIZE + 1), st.sampled_from(SESSIONS))
free = st.tuples(st.just("free"), st.integers(0, 5))
decode = st.tuples(st.just("decode"), st.integers(0, 5))
tick = st.tuples(st.just("tick"), st.sampled_from([1.0, 10.0, 40.0]))  # the clock moves (expiry)


def traffic_step(cache: Cache, n: int, op: tuple, running: list[Admission]) -> Any:
    """Operation `n` of the random-traffic tests, when it is traffic: ("admit", prefix, blocks,
    own, session) admits `blocks` blocks of shared prefix `prefix` and `own` tokens of its own
    into `running`, ("free", i) frees a running request, ("decode", i) decodes 5 tokens of one.
    Returns what an admission got ((hit tokens, block ids), or None when it did not fit), and
    None for the rest (nothing to do without a running request)."""
    kind = op[0]
    if kind == "admit":
        _, prefix, blocks, own, sid = op
        prompt = tokens(prefix, blocks * BLOCK_SIZE) + [60_000 + 100 * n + i for i in range(own)]
        admission = cache.admit(f"r{n}", prompt, sid)
        if admission is None:
            return None
        running.append(admission)
        return admission.hit_tokens, admission.block_ids
    if kind == "free" and running:
        cache.free(running.pop(op[1] % len(running)))
    elif kind == "decode" and running:
        cache.decode(running[op[1] % len(running)], 5)
    return None


def check_filing(pool: Any, core: KvHintCore, adapter: VllmAdapter, context: str = "") -> None:
    """The retention order's invariants, for any KV-cache layout (`context` starts each failure's
    message): every free block is counted free once, in vLLM's queue or protected; no grant
    outlives its block's residency; every free cached copy is filed by its logical block's
    class and priority (ordinary ones queued), and no in-use or uncached block is protected."""
    protected = pool._kvh_protected
    queued = {b.block_id for b in pool.free_block_queue.get_all_free_blocks()}
    kept = {b.block_id for b in protected.blocks()}
    free = {b.block_id for b in pool.blocks if b.ref_cnt == 0 and not b.is_null}
    assert not queued & kept, f"{context}a block both queued and protected"
    assert queued | kept == free, f"{context}free blocks lost or in-use blocks counted free"
    assert pool.get_num_free_blocks() == len(free) == protected.count + pool.free_block_queue.num_free_blocks
    # A grant ends with its block's last device copy (evicted, reclaimed, invalidated; no lower tier here).
    assert set(core.ledger.grants) <= adapter._resident, f"{context}a grant outlived its block"
    for block in pool.blocks:
        if block.ref_cnt or block.is_null or block.block_hash is None:
            assert block.block_id not in kept, f"{context}an in-use or uncached block is protected"
            continue
        view = core.retention(adapter.external(get_block_hash(block.block_hash)))
        filed = protected.filed_as(block)
        if view.cls is RetentionClass.ORDINARY:
            assert filed is None, f"{context}block {block.block_id} is ordinary but filed as {filed}"
        else:
            assert filed is not None and filed[:2] == (view.cls, view.priority), (
                f"{context}block {block.block_id} is {view.cls.name}/{view.priority} but filed as {filed}"
            )
