"""SessionPolicy through a FleetSink over real FleetClients (fake engines): an engine that fails
leaves its hints queued for the next flush, as a ClientSink's failed RPC does; only an answer
from every engine that none holds the session makes a hint MISSING (and the session cold)."""

from __future__ import annotations

import grpc
import pytest
from fake_kvhint_server import RunningServer, start_fake_server

from kvhint.v1 import kvhint_pb2 as pb
from kvhint_client.config import ConnectionConfig, RetryPolicy
from kvhint_client.errors import KvHintError
from kvhint_client.fleet import FleetClient
from kvhint_client.policy import FleetSink, RequestSent, SessionEnded, SessionPolicy, ToolCallStarted


def _engines(*holding: bool) -> list[RunningServer]:
    servers = [start_fake_server() for _ in holding]
    for server, holds in zip(servers, holding):
        server.servicer.sessions = [pb.SessionInfo(session_id="S")] if holds else []
    return servers


def _fleet(servers: list[RunningServer]) -> FleetClient:
    no_retry = RetryPolicy.disabled()
    return FleetClient({f"e{i}": ConnectionConfig(s.address, retry=no_retry) for i, s in enumerate(servers)})


def _paused_policy() -> SessionPolicy:
    policy = SessionPolicy(clock=lambda: 0.0)
    policy.observe(RequestSent("S", t=0.0))
    policy.observe(ToolCallStarted("S", tools=("run_tests",), t=1.0))
    return policy


def _actions(server: RunningServer) -> list[str | None]:
    return [hint.WhichOneof("action") for hint in server.servicer.applied]


def test_a_failed_apply_keeps_the_hint_queued_and_the_session_warm() -> None:
    """The engine holding S fails ApplyHints once: the flush raises, the Retain stays queued and is
    sent by the next flush (it used to come back MISSING: session cold, Retain dropped)."""
    (engine,) = servers = _engines(True)
    try:
        with _fleet(servers) as fleet:
            policy, sink = _paused_policy(), FleetSink(fleet)
            engine.servicer.fail_next["ApplyHints"] = [grpc.StatusCode.UNAVAILABLE]
            with pytest.raises(KvHintError) as info:
                policy.flush(sink, now=1.0)
            assert info.value.code == grpc.StatusCode.UNAVAILABLE and "'e0' failed" in str(info.value)
            assert policy.pending == 1 and not policy.sessions["S"].cold
            sent = policy.flush(sink, now=1.5)
        assert [(h.WhichOneof("action"), r.outcome) for h, r in sent] == [("retain", pb.OUTCOME_ACCEPTED)]
        assert _actions(engine) == ["retain"]
    finally:
        engine.stop()


def test_a_release_whose_routing_failed_is_sent_later() -> None:
    """The session ends while ListSessions fails once: the Release reaches the engine on the next
    flush (it used to be answered MISSING and never sent, leaving the Retain in place)."""
    (engine,) = servers = _engines(True)
    try:
        with _fleet(servers) as fleet:
            policy, sink = _paused_policy(), FleetSink(fleet)
            policy.flush(sink, now=1.0)
            policy.observe(SessionEnded("S", t=2.0))
            engine.servicer.fail_next["ListSessions"] = [grpc.StatusCode.UNAVAILABLE]
            with pytest.raises(KvHintError):
                policy.flush(sink, now=2.0)
            sent = policy.flush(sink, now=3.0)
        assert [h.WhichOneof("action") for h, _ in sent] == ["release"]
        assert _actions(engine) == ["retain", "release"]
    finally:
        engine.stop()


def test_a_hint_also_routed_to_a_failing_engine_is_resent_under_the_same_id() -> None:
    """Both engines hold S; one fails its batch. The whole batch is queued again under the same id:
    the engine that applied it replays its first result, the other applies it."""
    ok, failing = servers = _engines(True, True)
    try:
        with _fleet(servers) as fleet:
            policy, sink = _paused_policy(), FleetSink(fleet)
            failing.servicer.fail_next["ApplyHints"] = [grpc.StatusCode.UNAVAILABLE]
            with pytest.raises(KvHintError, match="'e1' failed"):
                policy.flush(sink, now=1.0)
            sent = policy.flush(sink, now=1.5)
        assert [r.outcome for _, r in sent] == [pb.OUTCOME_ACCEPTED]
        assert ok.servicer.applied[0].hint_id == failing.servicer.applied[0].hint_id == sent[0][0].hint_id
        assert ok.servicer.count("ApplyHints") == 2 and len(ok.servicer.applied) == 1, "the resend was replayed"
    finally:
        for server in servers:
            server.stop()


def test_missing_only_when_every_engine_answered_and_none_holds_it() -> None:
    servers = _engines(False, False)
    try:
        with _fleet(servers) as fleet:
            policy = _paused_policy()
            sent = policy.flush(FleetSink(fleet), now=1.0)
        assert [r.outcome for _, r in sent] == [pb.OUTCOME_MISSING] and policy.sessions["S"].cold
        assert not any(server.servicer.applied for server in servers)
    finally:
        for server in servers:
            server.stop()
