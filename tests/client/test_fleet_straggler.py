"""FleetClient.apply with one engine that never answers routing: the engines that answered still get
their batches, within the call's deadline (a straggler cannot starve them)."""

from __future__ import annotations

import threading
import time

import grpc
from fake_kvhint_server import FakeKvHint, start_fake_server

from kvhint.v1 import kvhint_pb2
from kvhint_client.builders import session
from kvhint_client.fleet import FleetClient


class HungListSessions(FakeKvHint):
    """An engine whose ListSessions never answers (engine thread stuck), until released or stopped."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def ListSessions(self, request, context):
        self._enter("ListSessions", context)
        while not self.release.wait(0.02) and not self._closing.is_set():
            pass  # no reply, whether or not the client has given up
        return super().ListSessions(request, context)


def test_a_hung_engine_does_not_starve_the_engine_holding_the_session() -> None:
    healthy, hung = start_fake_server(), start_fake_server(HungListSessions())
    healthy.servicer.sessions = [kvhint_pb2.SessionInfo(session_id=s) for s in ("S", "T")]
    timeout = 2.0
    try:
        with FleetClient({"healthy": healthy.address, "hung": hung.address}) as fleet:
            started = time.monotonic()
            out = fleet.apply(session("S").retain(ttl=30, hint_id="s"), session("T").pin(ttl=5, hint_id="t"),
                              session("elsewhere").evict(hint_id="x"), timeout=timeout)
            took = time.monotonic() - started
        assert took < timeout, f"apply(timeout={timeout}) took {took:.2f}s"
        assert [x.hint_id for x in healthy.servicer.applied] == ["s", "t"], "the healthy engine got its batch"
        assert out.per_engine["healthy"].all_accepted and set(out.per_engine) == {"healthy"}
        assert out.routes == {"s": ["healthy"], "t": ["healthy"], "x": []}
        # A hint only the hung engine might hold is reported, not dropped.
        assert [x.hint_id for x in out.unrouted] == ["x"] and not out.all_accepted
        error = out.errors["hung"]
        assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED and error.method == "ListSessions"
        assert "routing" in error.details and set(out.errors) == {"hung"}
        assert hung.servicer.count("ListSessions") == 1, "the hung engine is not asked again"
        assert not hung.servicer.applied and hung.servicer.count("ApplyHints") == 0
    finally:
        hung.servicer.release.set()
        healthy.stop()
        hung.stop()
