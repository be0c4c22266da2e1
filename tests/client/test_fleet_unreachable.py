"""FleetClient remembers the engines that failed to answer (circuit breaker): while an engine the
index cannot speak for is down or hung, later apply() calls skip it (reported in `skipped`, not in
`errors`) instead of paying its timeout on every hint, until its backoff has passed and one call
asks it again. And a follower whose engine names match none of the endpoints is refused."""

from __future__ import annotations

import logging
import threading
import time

import grpc
import pytest
from fake_kvhint_server import FakeKvHint, snapshot, start_fake_server

from kvhint.v1 import kvhint_pb2
from kvhint_client.builders import session
from kvhint_client.config import ConnectionConfig, RetryPolicy
from kvhint_client.fleet import FleetClient
from kvhint_client.follower import EngineTracker, EventFollower, ResidencyIndex


class HungListSessions(FakeKvHint):
    """An engine whose ListSessions never answers (engine thread stuck), until stopped."""

    def ListSessions(self, request, context):
        self._enter("ListSessions", context)
        while not self._closing.wait(0.02):
            pass
        return super().ListSessions(request, context)


def _index_with_a_on_e1() -> ResidencyIndex:
    """e1 live and holding session A; e2 known to the index but not live (its stream is down)."""
    index = ResidencyIndex()
    for engine, sessions in (("e1", {"A": [(1, [1])]}), ("e2", {})):
        tracker = EngineTracker(engine, engine, index)
        tracker.subscription()
        for message in snapshot("E", 1, sessions):
            tracker.handle(message)
    index.set_live("e2", False)
    return index


def _pin(i: int) -> kvhint_pb2.Hint:
    return session("A").pin(ttl=30, hint_id=f"p{i}")


def test_a_down_engine_is_asked_once_then_skipped_until_its_backoff_passes() -> None:
    e1 = start_fake_server()
    gone = start_fake_server()
    port = int(gone.address.rsplit(":", 1)[1])
    gone.stop()  # nothing listens there now: connections are refused
    e2 = None
    no_retry = RetryPolicy(max_attempts=1)
    endpoints = {"e1": e1.address, "e2": ConnectionConfig(gone.address, retry=no_retry)}
    try:
        with FleetClient(endpoints, follower=_index_with_a_on_e1(), breaker_backoff=0.5, breaker_max_backoff=5) as fleet:
            first = fleet.apply(_pin(0), timeout=5)
            assert first.errors["e2"].code == grpc.StatusCode.UNAVAILABLE and not first.skipped
            assert first.routes == {"p0": ["e1"]} and first.per_engine["e1"].all_accepted

            for i in (1, 2, 3):  # within the backoff: e2 is not asked
                out = fleet.apply(_pin(i), timeout=5)
                assert "e2" not in out.errors and set(out.skipped) == {"e2"}, out
                assert "failed to answer 1 call, the last UNAVAILABLE on ListSessions" in out.skipped["e2"]
                assert "may be asked again in" in out.skipped["e2"]
                assert out.per_engine["e1"].all_accepted and out.routes == {f"p{i}": ["e1"]}
                assert out.all_accepted, "a skipped engine is not a failure of the hint"

            time.sleep(0.55)  # the backoff has passed: one call asks e2 again, and it fails again
            probe = fleet.apply(_pin(4), timeout=5)
            assert probe.errors["e2"].code == grpc.StatusCode.UNAVAILABLE and not probe.skipped
            after = fleet.apply(_pin(5), timeout=5)
            assert "failed to answer 2 calls in a row" in after.skipped["e2"] and "backoff 1s" in after.skipped["e2"]

            e2 = start_fake_server(port=port)  # back: once the doubled backoff passes, asked and forgotten
            e2.servicer.sessions = [kvhint_pb2.SessionInfo(session_id="A")]
            time.sleep(1.05)  # > the 1s backoff, and > the channel's own reconnect backoff (0.5s +-20%)
            back = fleet.apply(_pin(6), timeout=5)
            assert not back.errors and not back.skipped and back.routes == {"p6": ["e1", "e2"]}
            again = fleet.apply(_pin(7), timeout=5)
            assert not again.skipped and again.routes == {"p7": ["e1", "e2"]}, "its answer ended the backoff"
            assert e2.servicer.count("ListSessions") == 2
        assert [h.hint_id for h in e1.servicer.applied] == [f"p{i}" for i in range(8)]
    finally:
        e1.stop()
        if e2 is not None:
            e2.stop()


def test_a_hung_engine_costs_one_slow_call_not_every_call() -> None:
    """The router engineer's trial: e2 hangs, its follower marks it not live, and every pin of a
    session the index places on e1 used to wait half the deadline for e2 (ROUTING_SHARE)."""
    e1, e2 = start_fake_server(), start_fake_server(HungListSessions())
    timeout = 1.0
    try:
        with FleetClient({"e1": e1.address, "e2": e2.address}, follower=_index_with_a_on_e1()) as fleet:
            took = []
            results = []
            for i in range(4):
                started = time.monotonic()
                results.append(fleet.apply(_pin(i), timeout=timeout))
                took.append(time.monotonic() - started)
            assert e2.servicer.count("ListSessions") == 1, "the hung engine is asked once, not by every call"
            # Asking e2 takes the routing share of the deadline (0.5s); the later calls do not ask it.
            assert took[0] >= timeout * 0.4 and max(took[1:]) < timeout * 0.45, took
            first, *later = results
            assert first.errors["e2"].code == grpc.StatusCode.DEADLINE_EXCEEDED
            for out in later:
                assert not out.errors and "the last DEADLINE_EXCEEDED on ListSessions" in out.skipped["e2"]
            assert all(out.per_engine["e1"].all_accepted and list(out.per_engine) == ["e1"] for out in results)
        assert [h.hint_id for h in e1.servicer.applied] == ["p0", "p1", "p2", "p3"]
    finally:
        e1.stop()
        e2.stop()


def test_the_breaker_never_skips_an_engine_the_index_places_a_hint_of_the_call_on() -> None:
    """e1 failed to apply (UNAVAILABLE) and so has a failure remembered; the index places A on
    e1, so the next call sends it its batch and asks it about B (which the index finds nowhere)
    like every engine, instead of skipping it; its answer ends the backoff."""
    e1, e2 = start_fake_server(), start_fake_server()
    e1.servicer.sessions = [kvhint_pb2.SessionInfo(session_id=s) for s in ("A", "B")]
    e1.servicer.fail_next["ApplyHints"] = [grpc.StatusCode.UNAVAILABLE]
    index = _index_with_a_on_e1()
    index.set_live("e2", True)
    no_retry = RetryPolicy(max_attempts=1)
    try:
        with FleetClient({"e1": ConnectionConfig(e1.address, retry=no_retry), "e2": e2.address}, follower=index) as fleet:
            failed = fleet.apply(_pin(0), timeout=5)
            assert failed.errors["e1"].code == grpc.StatusCode.UNAVAILABLE
            out = fleet.apply(_pin(1), session("B").evict(hint_id="b"), timeout=5)
            assert not out.skipped and out.all_accepted and out.routes == {"p1": ["e1"], "b": ["e1"]}
            assert e1.servicer.count("ListSessions") == 1 and e2.servicer.count("ListSessions") == 1
            assert fleet.apply(session("B").evict(hint_id="b2"), timeout=5).routes == {"b2": ["e1"]}
    finally:
        e1.stop()
        e2.stop()


def test_broadcast_asks_a_skipped_engine_and_breaker_zero_disables_it() -> None:
    e1 = start_fake_server()
    down = ConnectionConfig("127.0.0.1:1", retry=RetryPolicy(max_attempts=1))
    try:
        with FleetClient({"e1": e1.address, "e2": down}, follower=_index_with_a_on_e1()) as fleet:
            assert "e2" in fleet.apply(_pin(0), timeout=5).errors
            assert "e2" in fleet.apply(_pin(1), timeout=5).skipped
            wide = fleet.apply(_pin(2), broadcast=True, timeout=5)
            assert wide.errors["e2"].code == grpc.StatusCode.UNAVAILABLE and not wide.skipped
            assert "failed to answer 2 calls in a row" in fleet.apply(_pin(3), timeout=5).skipped["e2"]
        with FleetClient({"e1": e1.address, "e2": down}, follower=_index_with_a_on_e1(), breaker_backoff=0) as fleet:
            for i in (4, 5):
                out = fleet.apply(_pin(i), timeout=5)
                assert "e2" in out.errors and not out.skipped, "breaker_backoff=0: every call asks it"
    finally:
        e1.stop()


def test_an_engine_that_may_be_a_hints_only_holder_is_asked_despite_its_failures() -> None:
    """Without an index, and for a hint the index finds nowhere (B), every engine is asked, a
    remembered failure notwithstanding: skipping the down engine would leave such a hint
    unrouted, as if no engine held it (FleetSink answers that MISSING and drops the hint)."""
    e1 = start_fake_server()
    e1.servicer.sessions = [kvhint_pb2.SessionInfo(session_id="A")]
    down = ConnectionConfig("127.0.0.1:1", retry=RetryPolicy(max_attempts=1))
    try:
        with FleetClient({"e1": e1.address, "e2": down}) as fleet:
            for i in (0, 1):
                out = fleet.apply(_pin(i), timeout=5)
                assert out.errors["e2"].code == grpc.StatusCode.UNAVAILABLE and not out.skipped
                assert out.routes == {f"p{i}": ["e1"]}
        with FleetClient({"e1": e1.address, "e2": down}, follower=_index_with_a_on_e1()) as fleet:
            assert "e2" in fleet.apply(_pin(2), timeout=5).errors
            assert "e2" in fleet.apply(_pin(3), timeout=5).skipped  # A: the index places it on e1
            mixed = fleet.apply(_pin(4), session("B").evict(hint_id="b"), timeout=5)
            assert "e2" in mixed.errors and not mixed.skipped, "B: the index finds it nowhere"
            assert mixed.routes == {"p4": ["e1"], "b": []}
    finally:
        e1.stop()


@pytest.mark.parametrize(("backoff", "max_backoff"), [(-1, 30), (float("nan"), 30), (2, 1)])
def test_bad_breaker_settings_are_refused(backoff: float, max_backoff: float) -> None:
    with pytest.raises(ValueError, match="breaker_"):
        FleetClient({"e1": "127.0.0.1:1"}, breaker_backoff=backoff, breaker_max_backoff=max_backoff)


def test_a_follower_with_no_engine_name_in_common_is_refused() -> None:
    """Named by address in the follower, by name in the fleet: the index used to be ignored
    silently, every call asking every engine."""
    follower = EventFollower(["127.0.0.1:50151", "127.0.0.1:50152"])  # not started
    with pytest.raises(ValueError) as refused:
        FleetClient({"e1": "127.0.0.1:50151", "e2": "127.0.0.1:50152"}, follower=follower)
    message = str(refused.value)
    assert "['127.0.0.1:50151', '127.0.0.1:50152']" in message and "['e1', 'e2']" in message
    assert "share no name" in message
    with pytest.raises(ValueError, match="share no name"):
        FleetClient({"e1": "127.0.0.1:50151"}, follower=_only("x"))


def _only(engine: str) -> ResidencyIndex:
    index = ResidencyIndex()
    index.add_engine(engine)
    return index


def test_a_follower_with_some_names_differing_is_warned_about_once(caplog: pytest.LogCaptureFixture) -> None:
    e1 = start_fake_server()
    try:
        with caplog.at_level(logging.WARNING, logger="kvhint_client.fleet"):
            down = ConnectionConfig("127.0.0.1:1", retry=RetryPolicy(max_attempts=1))
            with FleetClient({"e1": e1.address, "e3": down}, follower=_index_with_a_on_e1()) as fleet:
                fleet.apply(_pin(0), timeout=5)
                fleet.apply(_pin(1), timeout=5)
        warnings = [r.getMessage() for r in caplog.records if r.name == "kvhint_client.fleet"]
        assert len(warnings) == 1 and "['e3']" in warnings[0] and "['e2']" in warnings[0], warnings
        # An index that has heard of no engine yet (a watch loop not started) is not checked.
        FleetClient({"e1": e1.address}, follower=ResidencyIndex()).close()
    finally:
        e1.stop()


def test_concurrent_calls_probe_a_down_engine_once() -> None:
    """Many threads at once after the backoff: one of them asks the hung engine again, the others
    skip it (and none waits for it)."""
    e1, e2 = start_fake_server(), start_fake_server(HungListSessions())
    try:
        with FleetClient({"e1": e1.address, "e2": e2.address}, follower=_index_with_a_on_e1(), breaker_backoff=0.2) as fleet:
            fleet.apply(_pin(0), timeout=0.6)  # e2 does not answer routing (0.3s): backoff 0.2s
            time.sleep(0.25)
            outs: list = [None] * 8
            barrier = threading.Barrier(8)

            def call(i: int) -> None:
                barrier.wait()
                outs[i] = fleet.apply(_pin(10 + i), timeout=2.0)  # a probe waits 1s for e2

            threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert e2.servicer.count("ListSessions") == 2, "one probe among the 8 calls"
            assert sum("e2" in out.errors for out in outs) == 1 and sum("e2" in out.skipped for out in outs) == 7
            assert all(out.per_engine["e1"].all_accepted for out in outs)
    finally:
        e1.stop()
        e2.stop()
