"""FleetClient.apply from several threads at once: the calls do not starve each other of the
client's thread pool, and a call that never got a worker says so instead of blaming the engine."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from fake_kvhint_server import start_fake_server, wait_until

from kvhint.v1 import kvhint_pb2
from kvhint_client.builders import session
from kvhint_client.fleet import FleetApplyResult, FleetClient


def test_concurrent_applies_from_several_threads_all_route_in_time() -> None:
    """Eight router threads, two healthy engines answering ListSessions in 0.5 s: every call is
    routed and applied. With one pool worker per engine shared by all calls, the calls queued
    behind each other, and those past the fourth reported both engines DEADLINE_EXCEEDED."""
    a, b = start_fake_server(), start_fake_server()
    for server in (a, b):
        server.servicer.sessions = [kvhint_pb2.SessionInfo(session_id=f"S{i}") for i in range(8)]
        server.servicer.delay["ListSessions"] = 0.5
    outs: dict[int, FleetApplyResult] = {}
    try:
        with FleetClient({"a": a.address, "b": b.address}) as fleet:

            def call(i: int) -> None:
                outs[i] = fleet.apply(session(f"S{i}").retain(ttl=30, hint_id=f"h{i}"), timeout=4.0)

            threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        for i in range(8):
            assert not outs[i].errors and outs[i].all_accepted, (i, outs[i].errors)
            assert outs[i].routes == {f"h{i}": ["a", "b"]}
        assert a.servicer.count("ListSessions") == b.servicer.count("ListSessions") == 8
    finally:
        a.stop()
        b.stop()


def test_a_call_that_never_got_a_worker_says_it_was_not_sent() -> None:
    """With every worker busy with another thread's apply(), the engines are not asked at all;
    the error says so (it used to say the engine did not answer ListSessions in time)."""
    a, b = start_fake_server(), start_fake_server()
    for server in (a, b):
        server.servicer.sessions = [kvhint_pb2.SessionInfo(session_id="S")]
        server.servicer.delay["ListSessions"] = 1.0
    try:
        with FleetClient({"a": a.address, "b": b.address}, max_workers=2) as fleet:
            first = threading.Thread(target=fleet.apply, args=(session("S").retain(ttl=30),), kwargs={"timeout": 8.0})
            first.start()
            assert wait_until(lambda: a.servicer.count("ListSessions") == b.servicer.count("ListSessions") == 1)
            started = time.monotonic()
            out = fleet.apply(session("S").release(hint_id="rel"), timeout=0.4)
            took = time.monotonic() - started
            first.join()
        assert took < 0.9, f"apply(timeout=0.4) took {took:.2f}s: it waited for the other call"
        assert set(out.errors) == {"a", "b"} and [x.hint_id for x in out.unrouted] == ["rel"]
        for error in out.errors.values():
            assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED and error.method == "ListSessions"
            assert "waited for a worker" in error.details and "max_workers=2" in error.details
            assert "was not sent" in error.details and "answered" not in error.details
        assert a.servicer.count("ListSessions") == b.servicer.count("ListSessions") == 1, "the second call asked no engine"
        assert "rel" not in [x.hint_id for server in (a, b) for x in server.servicer.applied]
    finally:
        a.stop()
        b.stop()


def test_max_workers_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="max_workers must be >= 1"):
        FleetClient({"a": "127.0.0.1:1"}, max_workers=0)
