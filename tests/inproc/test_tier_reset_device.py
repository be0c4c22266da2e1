"""EngineCore's cache reset (pause_scheduler(clear_cache=True), sleep) while a Demote's injected
store (TierControl.force_store) holds its device blocks.

vLLM's `Scheduler.reset_prefix_cache(reset_running_requests=True)` preempts every running request
so that no device block is in use, and raises RuntimeError when one still is: the store's pin
(BlockPool.touch until the worker reports the copy done) made every such reset fail, and the
engine with it. The store now gives its blocks back, the Demote fails (OPERATION_FAILED), and the
worker's later completion frees nothing twice.

A real KvHintScheduler with vLLM's real OffloadingConnector (scheduler role, KvHint's CPU spec)
over vLLM's real Scheduler/KVCacheManager/BlockPool; no model and no worker, so the worker's
completion is delivered by hand as the model runner's KVConnectorOutput.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import pytest
from vllm.config import KVEventsConfig, KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.structured_output import StructuredOutputManager

from engine_integration import inproc
from engine_integration.scheduler import KvHintScheduler
from engine_integration.tiers.config import tier_kv_transfer_config
from kvhint.v1 import kvhint_pb2 as pb
from kvhint_server.model import Outcome, Reason
from kvhint_server.operations import OperationState
from kvhint_server.validation import parse_apply_request

BS = 16
NUM_BLOCKS = 24


@pytest.fixture
def scheduler() -> Iterator[Any]:
    config = inproc.make_vllm_config(num_blocks=NUM_BLOCKS, block_size=BS)
    config.kv_transfer_config = KVTransferConfig(**tier_kv_transfer_config(host_blocks=8, platform="cpu"))
    config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    with inproc._env("KVHINT_GRPC_ADDRESS", "127.0.0.1:0"):
        s = KvHintScheduler(vllm_config=config, kv_cache_config=inproc.make_kv_cache_config(NUM_BLOCKS, BS),
                            structured_output_manager=StructuredOutputManager(config), block_size=BS,
                            hash_block_size=BS, log_stats=True)
    s._inproc_in_flight = deque()
    try:
        yield s
    finally:
        s.shutdown()


def _demote_decode_blocks(s: Any) -> tuple[str, Any]:
    """A finished request's decode blocks (only on the device: the connector stores prompt
    blocks) demoted: the operation's id and its injected store."""
    request = inproc.make_request("r1", list(range(100, 100 + BS)), max_tokens=2 * BS + 1, block_size=BS)
    s.add_request(request)
    for _ in range(4 * BS):  # the connector's own store of the prompt block never lands (no worker): step, not run_until_idle
        if "r1" in inproc.step(s).finished:
            break
    core = s.kvhint_core
    core.settle()
    decode = [s.kvhint_adapter.external(h) for h in request.block_hashes[1:]]
    hint = pb.Hint(selector=pb.Selector(block_hashes=pb.BlockHashSelector(block_hashes=decode)), demote=pb.DemoteAction())
    with core.exclusive():
        parsed = parse_apply_request(pb.ApplyHintsRequest(hints=[hint]), core.config, core.info)
        result = core.executor.apply_batch(parsed).results[0]
    assert result.outcome is Outcome.DEFERRED
    (store,) = s.kvhint_adapter.tiers.ctl._ops.values()
    assert [b.ref_cnt for b in store._blocks] == [1, 1], "the copy's device blocks are pinned"
    return result.operation_id, store


def _worker_reports_done(s: Any, job_id: int) -> None:
    s.connector.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs={job_id: 1})))


def _all_free(s: Any) -> bool:
    pool = s.kv_cache_manager.block_pool
    queue = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    return pool.get_num_free_blocks() == NUM_BLOCKS - 1 and len(queue) == len(set(queue)) == NUM_BLOCKS - 1


@pytest.mark.parametrize("reset_connector", [False, True], ids=["device cache", "device and connector caches"])
@pytest.mark.parametrize("handed_to_workers", [True, False], ids=["copy in flight", "copy not sent yet"])
def test_a_cache_reset_with_a_demote_copy_in_flight_succeeds_and_fails_the_demote(
    scheduler: Any, reset_connector: bool, handed_to_workers: bool
) -> None:
    s = scheduler
    ctl = s.kvhint_adapter.tiers.ctl
    operation_id, store = _demote_decode_blocks(s)
    blocks = list(store._blocks)
    host_before = ctl.host_used()
    if handed_to_workers:
        inproc.step(s)  # the step's connector metadata takes the store job to the workers
        assert store._job is None
    assert s.reset_prefix_cache(reset_running_requests=True, reset_connector=reset_connector) is True
    operation = s.kvhint_core.operations.get(operation_id)
    assert operation.state is OperationState.FAILED and operation.reason is Reason.OPERATION_FAILED
    assert "reset" in operation.message
    assert _all_free(s), "every device block is free: the reset went through"
    if handed_to_workers:
        _worker_reports_done(s, store.job_id)  # the copy the workers had ran
    assert store.done and store.failed and not ctl.busy()
    assert [b.ref_cnt for b in blocks] == [0, 0] and _all_free(s), "the completion freed nothing twice"
    assert ctl.host_used() <= host_before - 2, "the failed copy's host chunks are given back"
    # The engine goes on: a request takes the whole pool.
    s.add_request(inproc.make_request("big", list(range(7000, 7000 + (NUM_BLOCKS - 2) * BS)), max_tokens=1, block_size=BS))
    assert "big" in inproc.step(s).prefix_hits


def test_a_plain_reset_still_waits_for_the_copy(scheduler: Any) -> None:
    """Without reset_running_requests vLLM resets only when nothing holds a device block (it
    answers False otherwise, and the caller tries again): a Demote's copy in flight is such a
    holder, and goes on."""
    s = scheduler
    operation_id, store = _demote_decode_blocks(s)
    inproc.step(s)
    assert s.reset_prefix_cache() is False
    assert s.kvhint_core.operations.get(operation_id).state is OperationState.RUNNING
    assert [b.ref_cnt for b in store._blocks] == [1, 1]
    _worker_reports_done(s, store.job_id)
    assert store.done and not store.failed and _all_free(s)
    assert s.reset_prefix_cache() is True


def test_a_connector_reset_before_the_copy_is_sent_drops_it(scheduler: Any) -> None:
    """The Demote ran between steps (EngineCore's idle loop), so its copy is not sent yet, and a
    queued `/reset_prefix_cache?reset_external=true` resets the connector's cache (the device's
    answers False: the copy's blocks are pinned). The next step's stores get the reset host
    tier's chunks again; the stale copy must not go to the workers beside them, where it would
    write the demoted blocks' KV over a request's fresh host copy."""
    s = scheduler
    operation_id, store = _demote_decode_blocks(s)
    assert store._job is not None
    assert s.reset_prefix_cache(reset_connector=True) is False  # the copy's blocks were in use
    operation = s.kvhint_core.operations.get(operation_id)
    assert operation.state is OperationState.FAILED and "reset" in operation.message
    s.add_request(inproc.make_request("big", list(range(7000, 7000 + 3 * BS)), max_tokens=1, block_size=BS))
    meta = inproc.step(s).scheduled.kv_connector_metadata
    written = [int(c) for job in meta.store_jobs.values() for c in job.dst_spec.chunk_ids]
    assert written and len(written) == len(set(written)), f"two copies to one host chunk in one step: {written}"
    assert not s.kvhint_adapter.tiers.ctl.busy()
    assert s.reset_prefix_cache() is True, "the dropped copy gave its device blocks back: a retry resets"
