"""One tenant's calls hold at most its share of the engine-thread queue (overload.TenantQueueShares):
while the engine is in a long step, a tenant that floods the queue is refused past its share, and
another tenant's call still gets a place. Real server over loopback, fake engine."""

from __future__ import annotations

import json
import time
from pathlib import Path

import grpc
import pytest

from kvhint.v1 import kvhint_pb2 as pb

from kvhint_unit_support import Harness, error_info, gate_engine_steps, local_engine_info

TENANTS = {"tenants": [
    {"name": "team-a", "session_prefix": "a/", "tokens": ["tok-a"]},
    {"name": "team-b", "session_prefix": "b/", "tokens": ["tok-b"]},
]}
A, B = (("authorization", "Bearer tok-a"),), (("authorization", "Bearer tok-b"),)


def _held(hx: Harness, tenant: str, n: int) -> None:
    deadline = time.monotonic() + 5
    while hx.server.servicer.queue_shares.held(tenant) != n:
        assert time.monotonic() < deadline, f"{tenant} holds {hx.server.servicer.queue_shares.held(tenant)} places, expected {n}"
        time.sleep(0.005)


def test_a_tenant_flooding_the_engine_queue_leaves_room_for_another(tmp_path: Path) -> None:
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(TENANTS))
    hx = Harness(local_engine_info(), tenants_file=str(path), max_pending_tasks=4)
    try:
        steps = gate_engine_steps(hx)
        steps.clear()  # the engine is in a long step: calls queue
        time.sleep(0.05)
        queued = [hx.stub.ListSessions.future(pb.ListSessionsRequest(), metadata=A, timeout=10) for _ in range(2)]
        _held(hx, "team-a", 2)  # half of the 4-task queue
        for _ in range(2):
            with pytest.raises(grpc.RpcError) as err:
                hx.stub.ListSessions(pb.ListSessionsRequest(), metadata=A, timeout=10)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert error_info(err.value).metadata["cause"] == "queue_full"
            assert "tenant 'team-a''s share of the engine queue is full (2 tasks pending, bound 2)" in err.value.details()
        other = hx.stub.ListSessions.future(pb.ListSessionsRequest(), metadata=B, timeout=10)
        _held(hx, "team-b", 1)  # queued, not refused
        steps.set()
        assert other.result(timeout=10) is not None and all(f.result(timeout=10) is not None for f in queued)
        _held(hx, "team-a", 0)  # places are given back when the tasks are done
        _held(hx, "team-b", 0)
        assert hx.core.overload.queue_full == 2
    finally:
        hx.close()


def test_a_call_refused_for_a_full_share_gets_its_rate_limit_token_back(tmp_path: Path) -> None:
    """A ListSessions or QueryResidency refused queue_full ran nothing, and its RetryInfo says a retry
    can succeed soon: the retry must not then be refused rate_limited for the token the refused call
    was charged (a tenant limited to 3 calls in the next 100 s makes 3 calls that run)."""
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": [
        {"name": "team-a", "session_prefix": "a/", "tokens": ["tok-a"], "rate_limit_hints_per_s": 0.01, "rate_limit_burst": 3},
    ]}))
    hx = Harness(local_engine_info(), tenants_file=str(path), max_pending_tasks=4)
    try:
        steps = gate_engine_steps(hx)
        steps.clear()
        time.sleep(0.05)
        queued = [hx.stub.ListSessions.future(pb.ListSessionsRequest(), metadata=A, timeout=10) for _ in range(2)]
        _held(hx, "team-a", 2)  # two tokens spent on calls that will run
        query = pb.QueryResidencyRequest(selector=pb.Selector(session=pb.SessionSelector(session_id="a/s")))
        for refused in (lambda: hx.stub.ListSessions(pb.ListSessionsRequest(), metadata=A, timeout=10),
                        lambda: hx.stub.QueryResidency(query, metadata=A, timeout=10)):
            with pytest.raises(grpc.RpcError) as err:
                refused()
            assert error_info(err.value).metadata["cause"] == "queue_full"
        steps.set()
        assert all(f.result(timeout=10) is not None for f in queued)
        _held(hx, "team-a", 0)
        hx.stub.QueryResidency(query, metadata=A, timeout=10)  # the third token: still there
        with pytest.raises(grpc.RpcError) as err:  # and the bucket is really 3
            hx.stub.ListSessions(pb.ListSessionsRequest(), metadata=A, timeout=10)
        assert error_info(err.value).metadata["cause"] == "rate_limited"
    finally:
        hx.close()
