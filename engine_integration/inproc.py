"""In-process vLLM scheduler harness for tests and benchmarks (no model, no engine process).

Builds vLLM's REAL `Scheduler` / `AsyncScheduler` (or KvHint's subclasses) over a synthetic
KVCacheConfig, the way vLLM's own tests/v1/core/utils.py `create_scheduler` does, and feeds it
fake model-runner outputs. Blocks are allocated, cached, hit and evicted by vLLM's real
KVCacheManager and BlockPool; only the forward pass is missing.

Stable API:

- `make_scheduler(*, num_blocks, block_size=16, kvhint=True, async_scheduling=False, hybrid=False,
  sliding_window=128, max_num_seqs=16, max_num_batched_tokens=8192, enable_prefix_caching=True,
  max_model_len=None, data_parallel_rank=0, data_parallel_size=1, grpc_address="127.0.0.1:0")
  -> Scheduler`
    data_parallel_rank/size configure the scheduler as rank r of an N-rank DP group of a dense
    model exactly as vLLM's engine-core process does. kvhint=True builds
    `engine_integration.scheduler.KvHintScheduler` (an instance of
    `KvHintAsyncScheduler` when async_scheduling=True, exactly as `--scheduler-cls` does in a
    served engine); its sidecar serves gRPC on `grpc_address` (port 0: a free loopback port;
    read `scheduler.kvhint_server.address`). kvhint=False builds stock `Scheduler` /
    `AsyncScheduler`. hybrid=True gives two KV-cache groups: group 0 FullAttentionSpec, group 1
    SlidingWindowSpec(sliding_window) (a Gemma2-style model). Every scheduler built here must be
    closed: `close(scheduler)`, or use `running_scheduler(**same kwargs)` as a context manager.
- `make_request(request_id, prompt_token_ids, *, session_id=None, max_tokens=8, block_size=16,
  kv_hints=None, priority=0) -> vllm.v1.request.Request` with vLLM's block hasher (sha256, as
  EngineCore uses by default). `block_size` must match the scheduler's.
- `step(scheduler, *, sample=default_sample) -> StepResult`: one engine step. Sync: schedule(),
  a fake ModelRunnerOutput (one sampled token per scheduled request), update_from_output().
  Async (the scheduler is an AsyncScheduler): like EngineCore.step_with_batch_queue with 2
  batches in flight: schedule() while the previous batch's output is still pending (requests
  carry output placeholders), then deliver the oldest batch's output. `StepResult.prefix_hits`:
  request id -> tokens found cached when the request was first scheduled in this step.
- `on_engine_thread(scheduler_or_schedulers, fn, timeout=10)`: run `fn()` (typically gRPC calls to the sidecar)
  on a helper thread while this thread plays the idle engine (KvHintCore.run_pending() every
  millisecond), and return its result. RPCs that need the engine thread (ApplyHints, ListSessions,
  QueryResidency, ...) would otherwise wait for a step() that never comes.
- `drain(scheduler)`: deliver every in-flight output. `busy(scheduler)`: requests or outputs
  left. `run_until_idle(scheduler, max_steps)`: step until not busy; returns the finished
  request ids.
- `sample` maps (request, number of tokens already delivered) to the token id to sample; the
  default is deterministic, so sync and async runs of the same requests see the same tokens.

Engine-thread callbacks: KvHintScheduler runs `KvHintCore.run_pending()` at every schedule(),
so hints sent over gRPC apply at the next `step()`. There is no EngineCore, so the adapter's
idle wake-up is a no-op: a synchronous ApplyHints made from another thread completes at the
next step() on the test's thread (call ApplyHints from a thread and step() here).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from .served import default_model

HASH_ALGO = "sha256"
_IN_FLIGHT = "_inproc_in_flight"  # attribute on the scheduler: deque of pending SchedulerOutputs
_ASYNC_DEPTH = 2  # batches EngineCore keeps in flight with async scheduling (max_concurrent_batches)

_T = TypeVar("_T")
_hashers: dict[int, Callable[[Request], list[Any]]] = {}


def _block_hasher(block_size: int) -> Callable[[Request], list[Any]]:
    if block_size not in _hashers:
        hash_fn = get_hash_fn_by_name(HASH_ALGO)
        init_none_hash(hash_fn)
        _hashers[block_size] = get_request_block_hasher(block_size, hash_fn)
    return _hashers[block_size]


def make_kv_cache_config(
    num_blocks: int, block_size: int, *, hybrid: bool = False, window_only: bool = False, sliding_window: int = 128
) -> KVCacheConfig:
    """One FullAttention group; (hybrid) FullAttention group 0 + SlidingWindow group 1; or
    (window_only) one SlidingWindow group, the layout of a model whose every layer slides
    (Qwen2 with use_sliding_window and max_window_layers=0)."""
    if hybrid and window_only:
        raise ValueError("make_kv_cache_config: hybrid and window_only are different layouts; pick one")
    window = SlidingWindowSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=sliding_window
    )
    if window_only:
        groups = [KVCacheGroupSpec(["window.0"], window)]
    else:
        full = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
        groups = [KVCacheGroupSpec(["full.0"], full)]
        if hybrid:
            groups.append(KVCacheGroupSpec(["window.0"], window))
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def make_vllm_config(
    *,
    num_blocks: int,
    block_size: int = 16,
    async_scheduling: bool = False,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 8192,
    max_model_len: int | None = None,
    enable_prefix_caching: bool = True,
    data_parallel_rank: int = 0,
    data_parallel_size: int = 1,
    kv_events_endpoint: str | None = None,
) -> VllmConfig:
    """A VllmConfig for the generated tiny model (local directory, never a hub name).
    `kv_events_endpoint`: turn on vLLM's own KV cache events, published by its ZMQ publisher
    there (an ipc:// or tcp://*:port address, which it binds)."""
    max_model_len = max_model_len or min(max_num_batched_tokens, 4096)
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        async_scheduling=async_scheduling,
        is_encoder_decoder=False,
    )
    model_config = ModelConfig(model=default_model("tiny"), dtype="float32", seed=0, max_model_len=max_model_len, skip_tokenizer_init=True)
    cache_config = CacheConfig(
        block_size=block_size,
        cache_dtype="auto",
        enable_prefix_caching=enable_prefix_caching,
        prefix_caching_hash_algo=HASH_ALGO,
    )
    parallel_config = ParallelConfig(data_parallel_size=data_parallel_size)
    config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config, cache_config=cache_config, parallel_config=parallel_config)
    # VllmConfig's platform hook may rewrite this (the CPU platform forces async off); the
    # harness builds exactly the mode asked for, as vLLM's own scheduler tests do.
    config.scheduler_config.async_scheduling = async_scheduling
    if data_parallel_size > 1:
        # What EngineCoreProc.run_engine_core does in rank r's process for a dense model.
        config.parallel_config.data_parallel_index = data_parallel_rank
        config.parallel_config.reconfigure_for_independent_dp_rank()
    config.cache_config.num_gpu_blocks = num_blocks
    if kv_events_endpoint is not None:
        from vllm.config import KVEventsConfig

        config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=kv_events_endpoint)
    return config


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def make_scheduler(
    *,
    num_blocks: int,
    block_size: int = 16,
    kvhint: bool = True,
    async_scheduling: bool = False,
    hybrid: bool = False,
    window_only: bool = False,
    sliding_window: int = 128,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 8192,
    enable_prefix_caching: bool = True,
    max_model_len: int | None = None,
    data_parallel_rank: int = 0,
    data_parallel_size: int = 1,
    grpc_address: str = "127.0.0.1:0",
    kv_events_endpoint: str | None = None,
    edit_kv_cache_config: Callable[[KVCacheConfig], None] | None = None,
) -> Scheduler:
    """Build the scheduler (see the module doc). Close it with `close(scheduler)`.
    `edit_kv_cache_config` changes the KV-cache config before the scheduler is built (another
    group order or more groups, vLLM's prefix_cache_retention_interval)."""
    vllm_config = make_vllm_config(
        num_blocks=num_blocks,
        block_size=block_size,
        async_scheduling=async_scheduling,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
        data_parallel_rank=data_parallel_rank,
        data_parallel_size=data_parallel_size,
        kv_events_endpoint=kv_events_endpoint,
    )
    kv_cache_config = make_kv_cache_config(
        num_blocks, block_size, hybrid=hybrid, window_only=window_only, sliding_window=sliding_window
    )
    if edit_kv_cache_config is not None:
        edit_kv_cache_config(kv_cache_config)
    if kvhint:
        from .scheduler import KvHintScheduler

        cls: type[Scheduler] = KvHintScheduler
    else:
        cls = AsyncScheduler if async_scheduling else Scheduler
    with _env("KVHINT_GRPC_ADDRESS", grpc_address):
        scheduler = cls(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=block_size,
            hash_block_size=block_size,
            log_stats=True,
        )
    setattr(scheduler, _IN_FLIGHT, deque())
    return scheduler


def close(scheduler: Scheduler) -> None:
    """Stop the scheduler (and the KvHint sidecar, if any). Idempotent."""
    if getattr(scheduler, "_inproc_closed", False):
        return
    scheduler._inproc_closed = True  # type: ignore[attr-defined]
    scheduler.shutdown()


@contextlib.contextmanager
def running_scheduler(**kwargs: Any) -> Iterator[Scheduler]:
    """`make_scheduler(**kwargs)`, closed on exit."""
    scheduler = make_scheduler(**kwargs)
    try:
        yield scheduler
    finally:
        close(scheduler)


def make_request(
    request_id: str,
    prompt_token_ids: Sequence[int],
    *,
    session_id: str | None = None,
    max_tokens: int = 8,
    block_size: int = 16,
    kv_hints: Any = None,
    priority: int = 0,
) -> Request:
    """A vLLM Request as EngineCore builds it (block hashes filled in as tokens arrive)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=params,
        pooling_params=None,
        block_hasher=_block_hasher(block_size),
        session_id=session_id,
        kv_hints=kv_hints,
        priority=priority,
    )


def default_sample(request: Request, num_delivered: int) -> int:
    """A deterministic token: the same in sync and async runs of the same requests."""
    return 3 + (sum(map(ord, request.request_id)) * 31 + num_delivered) % 4000


@dataclass
class StepResult:
    """What one step() did."""

    #: The batch scheduled this step (None if nothing was scheduled).
    scheduled: SchedulerOutput | None
    #: The batch whose output was delivered this step (sync: the same as `scheduled`).
    delivered: SchedulerOutput | None
    #: Request ids that finished in the delivered batch.
    finished: list[str] = field(default_factory=list)

    @property
    def prefix_hits(self) -> dict[str, int]:
        """request id -> tokens found computed (prefix-cache hit) when first scheduled this step."""
        if self.scheduled is None:
            return {}
        return {new.req_id: new.num_computed_tokens for new in self.scheduled.scheduled_new_reqs}


def _model_runner_output(scheduler: Scheduler, out: SchedulerOutput, sample: Callable[[Request, int], int]) -> ModelRunnerOutput:
    req_ids = list(out.num_scheduled_tokens)
    tokens = []
    for req_id in req_ids:
        request = scheduler.requests.get(req_id)
        tokens.append([sample(request, len(request.output_token_ids))] if request is not None else [0])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=tokens,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
    )


def _deliver(scheduler: Scheduler, out: SchedulerOutput, sample: Callable[[Request, int], int]) -> list[str]:
    outputs = scheduler.update_from_output(out, _model_runner_output(scheduler, out, sample))
    finished: list[str] = []
    for engine_outputs in outputs.values():
        finished.extend(o.request_id for o in engine_outputs.outputs if o.finish_reason is not None)
    return finished


def _in_flight(scheduler: Scheduler) -> deque[SchedulerOutput]:
    return getattr(scheduler, _IN_FLIGHT)


def step(
    scheduler: Scheduler, *, sample: Callable[[Request, int], int] = default_sample,
    device_wait: Callable[[], None] | None = None,
) -> StepResult:
    """One engine step, as EngineCore.step (sync) or EngineCore.step_with_batch_queue (async).
    `device_wait`: called where EngineCore blocks on the model's output (`future.result()`,
    between schedule() and update_from_output() in both; vLLM 0.32 v1/engine/core.py), e.g.
    a sleep with the GIL free standing in for a GPU's forward pass."""
    pending = _in_flight(scheduler)
    if not isinstance(scheduler, AsyncScheduler):
        if not scheduler.has_requests():
            return StepResult(None, None)
        out = scheduler.schedule()
        if device_wait is not None:
            device_wait()
        return StepResult(out if out.total_num_scheduled_tokens else None, out, _deliver(scheduler, out, sample))
    scheduled = None
    if scheduler.has_requests():
        out = scheduler.schedule()
        pending.append(out)
        executed = out.total_num_scheduled_tokens > 0
        scheduled = out if executed else None
        if len(pending) < _ASYNC_DEPTH and (executed or scheduler.has_requests()):
            return StepResult(scheduled, None)  # fill the queue before waiting for an output
    elif not pending:
        return StepResult(None, None)
    delivered = pending.popleft()
    if device_wait is not None:
        device_wait()
    return StepResult(scheduled, delivered, _deliver(scheduler, delivered, sample))


def on_engine_thread(schedulers: Scheduler | Sequence[Scheduler], fn: Callable[[], _T], *, timeout: float = 10.0) -> _T:
    """Run fn() on a helper thread while this thread runs the sidecars' engine-thread tasks
    (one scheduler, or several: e.g. the ranks of a data-parallel group)."""
    cores = [s.kvhint_core for s in (schedulers if isinstance(schedulers, Sequence) else [schedulers])]  # type: ignore[attr-defined]
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="inproc-rpc") as pool:
        future = pool.submit(fn)
        deadline = time.monotonic() + timeout
        while not future.done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{fn!r} did not finish within {timeout}s")
            for core in cores:
                core.run_pending()
            time.sleep(0.001)
        return future.result()


def drain(scheduler: Scheduler, *, sample: Callable[[Request, int], int] = default_sample) -> list[str]:
    """Deliver every in-flight output (async); returns the finished request ids."""
    pending = _in_flight(scheduler)
    finished: list[str] = []
    while pending:
        finished += _deliver(scheduler, pending.popleft(), sample)
    return finished


def busy(scheduler: Scheduler) -> bool:
    """Unfinished (or finished, not yet reported) requests, or outputs in flight."""
    return bool(scheduler.has_requests() or _in_flight(scheduler))


def run_until_idle(scheduler: Scheduler, *, max_steps: int = 10_000, sample: Callable[[Request, int], int] = default_sample) -> list[str]:
    """step() until nothing is waiting, running or in flight; returns finished request ids."""
    finished: list[str] = []
    for _ in range(max_steps):
        if not busy(scheduler):
            return finished
        finished += step(scheduler, sample=sample).finished
    raise RuntimeError(f"scheduler still busy after {max_steps} steps")


__all__ = [
    "StepResult",
    "busy",
    "close",
    "default_sample",
    "drain",
    "make_kv_cache_config",
    "make_request",
    "make_scheduler",
    "make_vllm_config",
    "on_engine_thread",
    "run_until_idle",
    "running_scheduler",
    "step",
]
