"""vLLM's SimpleCPUOffloadConnector in lazy mode beside KvHint's retention order.

The lazy offloader (vllm/v1/simple_kv_offload/manager.py, `_prepare_lazy_store_specs`) walks the
device free queue from a cursor, the block its last walk stopped at, and copies the cached blocks
nearest eviction to the host. It takes for granted that a block leaves the queue only by gaining
a reference (its staleness check is `ref_cnt > 0`). KvHint files the free blocks a hint protects
out of the queue with no reference: a cursor left on such a block had no neighbours, and every
walk offloaded nothing for as long as the grant lasted. The pool now moves the cursor off a
block before taking it out of the queue.

A real KvHintScheduler with vLLM's real SimpleCPUOffloadConnector (scheduler role, lazy mode) over
vLLM's real Scheduler/KVCacheManager/BlockPool; no model and no worker: each step's store event is
reported done by hand, as the model runner's KVConnectorOutput would.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
from google.protobuf import duration_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.config import KVTransferConfig
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata
from vllm.v1.structured_output import StructuredOutputManager

from engine_integration import inproc
from engine_integration.scheduler import KvHintScheduler
from kvhint.v1 import kvhint_pb2 as pb
from kvhint_server.model import Outcome
from kvhint_server.validation import parse_apply_request

BS = 4
NUM_BLOCKS = 10  # 9 usable: the walk (8 blocks at 16 batched tokens) covers nearly the whole queue


class Engine:
    """The scheduler, its lazy offloader, and the device blocks each walk sent to the host."""

    def __init__(self, *, lazy: bool = True) -> None:
        config = inproc.make_vllm_config(num_blocks=NUM_BLOCKS, block_size=BS, max_num_batched_tokens=16, max_model_len=64)
        config.kv_transfer_config = KVTransferConfig(
            kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": 64 * 1024, "lazy_offload": lazy},
        )
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
        kv_cache_config = KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            kv_cache_tensors=[KVCacheTensor(size=NUM_BLOCKS * 1024, layers=["l0"], layer_stride=0, block_stride=1024)],
            kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)],
        )
        with inproc._env("KVHINT_GRPC_ADDRESS", "127.0.0.1:0"):
            self.s = KvHintScheduler(vllm_config=config, kv_cache_config=kv_cache_config,
                                     structured_output_manager=StructuredOutputManager(config), block_size=BS,
                                     hash_block_size=BS, log_stats=True)
        self.s._inproc_in_flight = deque()
        self.pool = self.s.kv_cache_manager.block_pool
        self.offloader = self.s.connector.scheduler_manager
        self.offloaded: list[int] = []

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.s.shutdown()

    def step(self) -> list[str]:
        result = inproc.step(self.s)
        meta = result.delivered.kv_connector_metadata if result.delivered is not None else None
        if meta is not None and meta.store_event >= 0:  # the workers copied the walk's blocks
            self.offloaded.extend(meta.store_gpu_blocks)
            self.s.connector.update_connector_output(KVConnectorOutput(
                kv_connector_worker_meta=SimpleCPUOffloadWorkerMetadata(completed_store_events={meta.store_event: 1})))
        return result.finished

    def run(self, request_id: str, first_token: int, session: str | None = None) -> list[int]:
        """A request of two full blocks (and one token), run to the end; its full blocks' ids."""
        request = inproc.make_request(request_id, list(range(first_token, first_token + 2 * BS + 1)), session_id=session,
                                      max_tokens=1, block_size=BS)
        self.s.add_request(request)
        for _ in range(5):
            if request_id in self.step():
                break
        found = [self.pool.get_cached_block(h, [0]) for h in request.block_hashes[:2]]
        return [f[0].block_id for f in found if f is not None]

    def hint(self, action: str, session: str) -> Outcome:
        ttl = duration_pb2.Duration(seconds=600)
        actions = {
            "pin": {"pin": pb.PinAction(ttl=ttl)},
            "retain": {"retain": pb.RetainAction(ttl=ttl)},
            "release": {"release": pb.ReleaseAction()},
            "evict": {"evict": pb.EvictAction()},
        }
        hint = pb.Hint(selector=pb.Selector(session=pb.SessionSelector(session_id=session)), **actions[action])
        core = self.s.kvhint_core
        with core.exclusive():
            parsed = parse_apply_request(pb.ApplyHintsRequest(hints=[hint]), core.config, core.info)
            return core.executor.apply_batch(parsed).results[0].outcome

    def cursor_dangles(self) -> bool:
        """The offloader's cursor is a free block out of the queue (vLLM's walk visits nothing after it)."""
        cursor = self.offloader._cursor
        return cursor is not None and cursor.ref_cnt == 0 and cursor.next_free_block is None


def test_the_lazy_offloader_keeps_offloading_while_a_pin_holds_the_block_it_stopped_at() -> None:
    with Engine() as e:
        kept = e.run("kept", 100, session="keep")
        e.step()
        e.step()
        # The walk copied kept's blocks to the host; it stopped at one of them, back in the queue.
        assert e.offloader._cursor is not None and e.offloader._cursor.block_id in kept
        assert e.hint("pin", "keep") is Outcome.ACCEPTED  # kept's blocks leave the free queue
        for i in range(1, 5):
            e.offloaded.clear()
            blocks = e.run(f"other{i}", 1000 * i)
            e.step()
            e.step()
            assert len(blocks) == 2 and set(blocks) <= set(e.offloaded), f"other{i}'s finished blocks are offloaded to the host"


def test_the_pool_watches_only_a_lazy_offloader() -> None:
    with Engine(lazy=True) as lazy, Engine(lazy=False) as eager:
        assert lazy.pool._kvh_lazy == (lazy.offloader,)
        assert eager.pool._kvh_lazy == ()


# ---------------------------------------------------------------- property

ops_st = st.lists(
    st.one_of(
        st.tuples(st.just("run"), st.integers(0, 3)),  # a request of session s<i>
        st.tuples(st.sampled_from(["pin", "retain", "release", "evict"]), st.integers(0, 3)),
        st.tuples(st.just("step"), st.just(0)),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops_st)
def test_hints_never_leave_the_lazy_cursor_outside_the_free_queue(ops: list[tuple[str, int]]) -> None:
    """Whatever the traffic and the hints (Pin and Retain file blocks out of the queue, Release
    and Evict put them back), the offloader's cursor is never a free block out of the queue."""
    with Engine() as e:
        for n, (op, i) in enumerate(ops):
            if op == "run":
                e.run(f"r{n}", 100 * (n + 1), session=f"s{i}")
            elif op == "step":
                if e.s.has_requests():
                    e.step()
            else:
                e.hint(op, f"s{i}")
            assert not e.cursor_dangles(), f"after {op} s{i}"
