"""A Demote's injected store (TierControl.force_store) still in flight when the KV connector's
cache is reset (`reset_prefix_cache` with `reset_connector`, `/reset_prefix_cache?reset_external=true`,
sleep and pause with cache clearing). The store's job goes to the worker in one step's metadata and
completes at the next; a reset can land between the two. vLLM drops its own such jobs; KvHint's
completion must not land against the reset manager: with a file tier it cascaded chunks the reset
manager no longer held and failed the engine step (AssertionError out of update_from_output,
which ends EngineCore), and on the host tier alone it marked a later request's chunk of the same
key ready before that request's copy ran. Real BlockPool, real CPU and tiering managers; the
connector is a stub with what TierControl touches."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from engine_integration import vllm_private
from engine_integration.tiers.control import TierControl
from pool_support import Cache
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingConnectorMetadata, OffloadingWorkerMetadata
from vllm.v1.kv_offload.base import OffloadPolicy, ReqContext, RequestOffloadingContext, LookupResult
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.tiering.manager import CPUPrimaryTierOffloadingManager, TieringOffloadingManager


class _Region:
    def __init__(self, n: int) -> None:
        self.a = np.zeros((n, 64), dtype=np.uint8)

    def create_kv_memoryview(self) -> memoryview:
        return memoryview(self.a)

    def cleanup(self) -> None:
        pass


class _FileTier:
    """A secondary tier that takes every write and finishes it at once."""

    tier_type, medium, locality, bp_detector, cache_hit_source, events = "null", "STORAGE", None, None, None, None

    def __init__(self) -> None:
        self.done: list[Any] = []

    def on_new_request(self, ctx: Any) -> RequestOffloadingContext:
        return RequestOffloadingContext(policy=OffloadPolicy.CHUNK_LEVEL)

    def on_request_finished(self, ctx: Any) -> None: ...
    def lookup(self, key: Any, ctx: Any) -> LookupResult: return LookupResult.MISS
    def touch(self, keys: Any, ctx: Any) -> None: ...
    def take_events(self) -> Any: return iter(())
    def drain_jobs(self) -> None: ...
    def serve_external_requests(self, parent: Any) -> None: ...
    def on_schedule_end(self, ctx: Any) -> None: ...
    def has_pending_work(self) -> bool: return bool(self.done)

    def submit_store(self, job: Any) -> None:
        from vllm.v1.kv_offload.tiering.base import JobResult

        self.done.append(JobResult(job_id=job.job_id, success=True))

    def get_finished_jobs(self) -> list[Any]:
        done, self.done = self.done, []
        return done


def _setup(file_tier: bool) -> tuple[Cache, Any, TierControl]:
    cache = Cache(num_blocks=24, hooked=False)
    if file_tier:
        manager: Any = TieringOffloadingManager(CPUPrimaryTierOffloadingManager(num_chunks=8, mmap_region=_Region(8)), [_FileTier()])
    else:
        manager = CPUOffloadingManager(num_chunks=8)
    counter = itertools.count()
    cs = SimpleNamespace(manager=manager, _generate_job_id=lambda: next(counter),
                         config=SimpleNamespace(kv_group_configs=[SimpleNamespace(group_idx=0)], blocks_per_chunk=1,
                                                num_workers=1, tokens_per_hash=4))
    connector = SimpleNamespace(connector_scheduler=cs,
                                build_connector_meta=lambda so: OffloadingConnectorMetadata(load_jobs={}, store_jobs={}),
                                update_connector_output=lambda out: None, has_pending_push_work=lambda: False,
                                take_events=lambda: iter(()))
    ctl = TierControl(SimpleNamespace(connector=connector, kv_cache_manager=cache.manager))
    # As TierRuntime wires it: after the manager's reset, the stores in flight are dropped.
    vllm_private.after_reset_cache(manager, ctl.drop_in_flight_stores)
    return cache, manager, ctl


@pytest.mark.parametrize("file_tier", [False, True], ids=["host tier", "host and file tiers"])
def test_a_store_in_flight_across_a_connector_reset_only_unpins_its_blocks(file_tier: bool) -> None:
    cache, manager, ctl = _setup(file_tier)
    admitted = cache.run("r1", list(range(8)))  # two full blocks cached on the device
    hashes = [bytes(h) for h in admitted.request.block_hashes]
    done: list[Any] = []
    store = ctl.force_store(hashes, on_done=done.append)
    blocks = list(store._blocks)
    assert [b.ref_cnt for b in blocks] == [1, 1], "pinned until the copy ran"
    meta = ctl.connector.build_connector_meta(None)  # step N: the job goes to the worker
    assert store.job_id in meta.store_jobs
    manager.reset_cache()  # between the steps
    # A request stores block 0 again after the reset; its copy has not run yet.
    ctx = ReqContext(req_id="R")
    manager.on_new_request(ctx)
    assert manager.prepare_store([ctl.key(hashes[0])], ctx) is not None
    # Step N+1: the worker reports the dropped job done. Nothing raises out of the engine step.
    out = SimpleNamespace(kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs={store.job_id: 1}))
    ctl.connector.update_connector_output(out)
    assert [b.ref_cnt for b in blocks] == [0, 0], "the device blocks are unpinned"
    assert done == [store] and store.done and store.failed and "reset" in store.failed
    assert not ctl.busy()
    assert manager.lookup(ctl.key(hashes[0]), ctx) is LookupResult.HIT_PENDING, "the request's own copy is still pending"
    assert manager.lookup(ctl.key(hashes[1]), ReqContext(req_id="p")) is LookupResult.MISS


@pytest.mark.parametrize("file_tier", [False, True], ids=["host tier", "host and file tiers"])
def test_a_store_not_yet_sent_at_a_connector_reset_never_writes_the_reset_tiers_chunks(file_tier: bool) -> None:
    """A Demote started between steps (EngineCore's idle loop runs the hint, then a queued
    `/reset_prefix_cache?reset_external=true` before the next step) has its store prepared but not
    yet handed to the workers. The reset gives its host chunks back; the next step's stores get
    them again. Handed over in that step (after vLLM's own jobs), the stale copy would overwrite
    a request's fresh host copy with the demoted block's KV."""
    cache, manager, ctl = _setup(file_tier)
    admitted = cache.run("r1", list(range(8)))
    hashes = [bytes(h) for h in admitted.request.block_hashes]
    store = ctl.force_store(hashes)
    blocks = list(store._blocks)
    assert store._job is not None, "prepared, not yet sent"
    manager.reset_cache()  # between the steps
    # The next step: a request's store is given host chunks of the reset tier ...
    ctx = ReqContext(req_id="R")
    manager.on_new_request(ctx)
    fresh = manager.prepare_store([ctl.key(b"\x07" * 32)], ctx)
    assert fresh is not None
    taken = set(int(c) for c in fresh.store_spec.chunk_ids)
    # ... and the step's metadata goes to the workers.
    meta = ctl.connector.build_connector_meta(None)
    written = {int(c) for job in meta.store_jobs.values() for c in job.dst_spec.chunk_ids}
    assert not written & taken, f"a stale copy writes host chunks {sorted(written & taken)} the reset tier gave request R"
    assert [b.ref_cnt for b in blocks] == [0, 0], "the device blocks are unpinned"
    assert store.done and store.failed and "reset" in store.failed and not ctl.busy()
    assert manager.lookup(ctl.key(b"\x07" * 32), ctx) is LookupResult.HIT_PENDING
