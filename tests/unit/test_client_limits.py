"""The typed client takes id and batch limits from the server (GetCapabilities), not from
copies of the defaults; and UNAVAILABLE says why (engine stopped vs no step boundary)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import grpc
import pytest
from kvhint_unit_support import Harness, error_info

from kvhint.v1 import kvhint_pb2 as pb
from kvhint_client import KvHintClient
from kvhint_client.builders import session


def test_client_checks_the_servers_limits_once_known(make_harness: Callable[..., Harness]) -> None:
    harness = make_harness(max_id_length=8, max_hint_id_length=40, max_hints_per_batch=2)
    with KvHintClient(f"127.0.0.1:{harness.port}") as kv:
        # Before capabilities are read, the server is the judge: the hint is REJECTED.
        (before,) = kv.apply(session("s" * 9).pin(ttl=5))
        assert before.outcome == pb.OUTCOME_REJECTED and before.reason == pb.REASON_INVALID_HINT
        assert kv.limits is None
        kv.capabilities()
        assert kv.limits.max_id_length == 8
        cases = [
            ((session("s" * 9).pin(ttl=5),), "selector.session.session_id is 9 bytes; the server accepts at most 8"),
            ((session("S").pin(ttl=5, hint_id="h" * 41),), "hint_id is 41 bytes; the server accepts at most 40"),
            ((session("A").pin(ttl=5),) * 3, "3 hints; the server takes at most 2"),
        ]
        for hints, message in cases:
            with pytest.raises(ValueError, match=message):
                kv.apply(*hints)
        assert kv.apply(session("s" * 8).pin(ttl=5, hint_id="h" * 40))[0].hint_id == "h" * 40


def test_ids_longer_than_the_default_go_through_when_the_server_allows_them(make_harness: Callable[..., Harness]) -> None:
    harness = make_harness(max_id_length=1024)
    with KvHintClient(f"127.0.0.1:{harness.port}") as kv:
        kv.capabilities()
        (result,) = kv.apply(session("s" * 600).release())
        assert result.hint_id  # answered by the server, not refused by a client-side 256-byte copy


def test_no_step_boundary_is_unavailable_with_deadline_reason(make_harness: Callable[..., Harness]) -> None:
    harness = make_harness(engine_task_timeout_s=0.2)
    gate = threading.Event()
    harness.core.submit(lambda: gate.wait(5))  # the engine thread is busy: no step boundary
    try:
        with pytest.raises(grpc.RpcError) as info:
            harness.stub.ListSessions(pb.ListSessionsRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert error_info(info.value).reason == "REASON_DEADLINE_EXCEEDED"
    finally:
        gate.set()


def test_stopped_engine_is_unavailable_shutting_down(make_harness: Callable[..., Harness]) -> None:
    harness = make_harness()
    harness.core.stop()
    with pytest.raises(grpc.RpcError) as info:
        harness.stub.ListSessions(pb.ListSessionsRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert error_info(info.value).reason == "REASON_SHUTTING_DOWN"
