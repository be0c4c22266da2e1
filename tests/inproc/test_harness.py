"""The in-process harness drives vLLM's real scheduler: a repeated prompt hits the prefix cache,
async scheduling keeps output placeholders in flight, and KvHint's sidecar starts and stops."""

from __future__ import annotations

import grpc
import pytest
from vllm.v1.core.sched.async_scheduler import AsyncScheduler

from engine_integration import inproc
from kvhint_client import KvHintClient

BLOCK = 16
PROMPT = list(range(100, 100 + 5 * BLOCK))  # 5 full blocks


def _send_then_resume(scheduler: object) -> int:
    """Finish a 5-block prompt, then send it again with 2 more tokens; the resume's prefix hit."""
    scheduler.add_request(inproc.make_request("first", PROMPT, session_id="s", max_tokens=3))
    assert inproc.run_until_idle(scheduler) == ["first"]
    scheduler.add_request(inproc.make_request("resume", PROMPT + [7, 8], session_id="s", max_tokens=3))
    result = inproc.step(scheduler)
    assert inproc.run_until_idle(scheduler) == ["resume"]
    return result.prefix_hits["resume"]


@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stock_scheduler_prefix_hit(async_scheduling: bool, hybrid: bool) -> None:
    with inproc.running_scheduler(num_blocks=32, kvhint=False, async_scheduling=async_scheduling, hybrid=hybrid, sliding_window=32) as scheduler:
        assert isinstance(scheduler, AsyncScheduler) is async_scheduling
        assert len(scheduler.kv_cache_config.kv_cache_groups) == (2 if hybrid else 1)
        assert _send_then_resume(scheduler) == len(PROMPT)


def test_async_step_keeps_placeholders_in_flight() -> None:
    with inproc.running_scheduler(num_blocks=32, kvhint=False, async_scheduling=True) as scheduler:
        request = inproc.make_request("r", PROMPT, max_tokens=4)
        scheduler.add_request(request)
        first = inproc.step(scheduler)
        assert first.scheduled is not None and first.delivered is None
        assert request.num_output_placeholders == 1
        second = inproc.step(scheduler)  # schedules the next decode, then delivers the prefill
        assert second.delivered is first.scheduled
        assert request.num_output_placeholders == 1 and len(request.output_token_ids) == 1
        assert inproc.run_until_idle(scheduler) == ["r"]
        assert len(request.output_token_ids) == 4


def test_kvhint_scheduler_serves_and_closes() -> None:
    scheduler = inproc.make_scheduler(num_blocks=32, kvhint=True)
    address = scheduler.kvhint_server.address
    try:
        assert _send_then_resume(scheduler) == len(PROMPT)
        with KvHintClient(address) as client:
            caps = client.capabilities(timeout=5)
            assert caps.num_device_blocks == 32 and caps.block_size == BLOCK
            sessions = inproc.on_engine_thread(scheduler, lambda: client.list_sessions_page(timeout=5).sessions)
            assert [s.session_id for s in sessions] == ["s"]
    finally:
        inproc.close(scheduler)
    with pytest.raises(grpc.FutureTimeoutError), grpc.insecure_channel(address) as channel:  # port closed
        grpc.channel_ready_future(channel).result(timeout=1)
