"""A KvHintScheduler with vLLM's real OffloadingConnector (scheduler side: the host tier's
CPUOffloadingManager and, optionally, the fs file tier) in-process, no model: every transfer
job the connector hands out is reported done in the step that hands it out (the worker's
copy itself is not under test). Dense or hybrid (full attention + a 64-token sliding window,
either group first), for tests/inproc/test_tiers_hybrid_copies.py."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from vllm.config import KVEventsConfig, KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.v1.kv_cache_interface import KVCacheTensor
from vllm.v1.kv_offload.base import LookupResult
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.structured_output import StructuredOutputManager

from engine_integration import inproc
from engine_integration.scheduler import KvHintScheduler
from engine_integration.tiers.config import tier_kv_transfer_config
from kvhint.v1 import kvhint_pb2 as pb
from kvhint_server.model import HintResult
from kvhint_server.validation import parse_apply_request

BLOCK = 16
WINDOW = 64


@contextlib.contextmanager
def tiered(*, window_first: bool = False, hybrid: bool = True, num_blocks: int = 48, host_blocks: int = 16,
           policy: str = "lru", file_root: str | None = None) -> Iterator[Any]:
    """The scheduler; `policy` "kvhint" makes the host tier honour retention."""
    config = inproc.make_vllm_config(num_blocks=num_blocks, block_size=BLOCK)
    config.kv_transfer_config = KVTransferConfig(**tier_kv_transfer_config(
        host_blocks=host_blocks, platform="cpu", eviction_policy=policy, file_root=file_root, file_events=True))
    config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    kv = inproc.make_kv_cache_config(num_blocks, BLOCK, hybrid=hybrid, sliding_window=WINDOW)
    # 256 bytes per block and layer (the file tier sizes its files from them, and an operation's
    # bytes_moved counts copies of bytes_per_block, here 512 bytes).
    layers = [name for group in kv.kv_cache_groups for name in group.layer_names]
    kv.kv_cache_tensors = [KVCacheTensor(size=num_blocks * 256, layers=[name], layer_stride=0, block_stride=256)
                           for name in layers]
    if hybrid:
        kv.prefix_cache_retention_interval = 0  # the engine's default: window tails only
        if window_first:
            kv.kv_cache_groups.reverse()
    with inproc._env("KVHINT_GRPC_ADDRESS", "127.0.0.1:0"):
        s = KvHintScheduler(vllm_config=config, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(config),
                            block_size=BLOCK, hash_block_size=BLOCK, log_stats=True)
    try:
        yield s
    finally:
        s.shutdown()


def step(s: Any) -> Any:
    """One step; the connector's jobs of this step complete with it."""
    out = s.schedule()
    meta = out.kv_connector_metadata
    result = inproc._model_runner_output(s, out, inproc.default_sample)
    if meta is not None:
        jobs = dict(meta.load_jobs) | dict(meta.store_jobs)
        loading = {job.req_id for job in meta.load_jobs.values()}
        result.kv_connector_output = KVConnectorOutput(
            finished_recving=loading or None,
            kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs={job: 1 for job in jobs}))
    s.update_from_output(out, result)
    return out


def drive(s: Any, steps: int = 300) -> None:
    """Step while the scheduler has work (requests, or a tier operation in flight)."""
    for _ in range(steps):
        if not s.has_requests():
            break
        step(s)
        time.sleep(0.002)  # the file tier's probes and writes run on its own threads
    s.kvhint_core.settle()


def run(s: Any, rid: str, prompt: list[int], sid: str | None = None) -> None:
    s.add_request(inproc.make_request(rid, prompt, session_id=sid, max_tokens=1, block_size=BLOCK))
    drive(s)


def apply(s: Any, *hints: pb.Hint) -> list[HintResult]:
    core = s.kvhint_core
    with core.exclusive():
        parsed = parse_apply_request(pb.ApplyHintsRequest(hints=list(hints)), core.config, core.info)
        return core.executor.apply_batch(parsed).results


def operation(s: Any, hint: pb.Hint) -> Any:
    """Apply `hint` (a tier action), step until its operation is done, and return it."""
    (result,) = apply(s, hint)
    drive(s)
    return s.kvhint_core.operations.get(result.operation_id)


def hashes_of(prompt: list[int]) -> list[bytes]:
    return [bytes(h) for h in inproc.make_request("probe", prompt, block_size=BLOCK).block_hashes]


def host_copies(s: Any, prompt: list[int]) -> dict[int, list[int]]:
    """group id -> the positions of `prompt`'s blocks whose host copy in that group is valid."""
    ctl = s.kvhint_adapter.tiers.ctl
    chain = hashes_of(prompt)
    return {g: [i for i, h in enumerate(chain) if ctl.primary.lookup(ctl.key(h, g), ctl._probe) is LookupResult.HIT]
            for g in ctl.group_ids}


def device_copies(s: Any, prompt: list[int]) -> dict[int, list[int]]:
    """group id -> the positions of `prompt`'s blocks the device pool holds a copy of there."""
    ctl, pool = s.kvhint_adapter.tiers.ctl, s.kv_cache_manager.block_pool
    chain = hashes_of(prompt)
    return {g: [i for i, h in enumerate(chain) if pool.get_cached_block(h, [g]) is not None] for g in ctl.group_ids}


def copies(by_group: dict[int, list[int]]) -> int:
    return sum(len(positions) for positions in by_group.values())


def host_hit(s: Any, prompt: list[int], rid: str = "probe-hit") -> int:
    """Tokens vLLM's connector would load for `prompt` from the host tier alone (its own lookup,
    `get_num_new_matched_tokens`, with nothing on the device)."""
    cs = s.connector.connector_scheduler
    real = cs.manager
    cs.manager = s.kvhint_adapter.tiers.ctl.primary
    try:
        request = inproc.make_request(rid, prompt, block_size=BLOCK)
        cs.on_new_request(request)
        n, _ = cs.get_num_new_matched_tokens(request, 0)
        cs.manager.on_request_finished(cs._req_status[rid].req_context)
        del cs._req_status[rid]
    finally:
        cs.manager = real
    return n
