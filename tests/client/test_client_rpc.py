"""KvHintClient / AsyncKvHintClient against the in-process fake server (engine-neutral)."""

from __future__ import annotations

import asyncio
import math
import threading

import grpc
import pytest
from fake_kvhint_server import HANG, RunningServer, heartbeat, stored

from kvhint.v1 import kvhint_pb2
from kvhint_client import AsyncKvHintClient, ConnectionConfig, KvHintClient, KvHintError, RetryPolicy, session
from kvhint_client.builders import blocks, continuation

FAST_RETRY = RetryPolicy(max_attempts=4, initial_backoff=0.01, max_backoff=0.05, jitter=0.0)


def client_for(fake: RunningServer, **overrides) -> KvHintClient:
    return KvHintClient(ConnectionConfig(address=fake.address, retry=FAST_RETRY, **overrides))


# -- apply, ids and retries ---------------------------------------------------------------------------


def test_apply_returns_results_in_order_with_helpers(fake: RunningServer) -> None:
    def outcome(hint):
        if hint.WhichOneof("action") == "evict":
            return kvhint_pb2.HintResult(hint_id=hint.hint_id, outcome=kvhint_pb2.OUTCOME_MISSING,
                                         reason=kvhint_pb2.REASON_NOT_RESIDENT)
        return kvhint_pb2.HintResult(hint_id=hint.hint_id, outcome=kvhint_pb2.OUTCOME_ACCEPTED)

    fake.servicer.outcome_for = outcome
    with client_for(fake) as kv:
        result = kv.apply(session("S").pin(ttl=30), continuation("c").evict(hint_id="mine"))
    assert result.outcomes == ["ACCEPTED", "MISSING"]
    assert not result.all_accepted and not result.all_applied
    assert [r.hint_id for r in result.by_outcome["MISSING"]] == ["mine"]
    assert result.result_for("mine").reason == kvhint_pb2.REASON_NOT_RESIDENT
    assert result.epoch == "E1" and result.applied_at_sequence == 101
    assert len(result) == 2 and result[0].outcome == kvhint_pb2.OUTCOME_ACCEPTED


def test_hints_without_id_get_a_uuid_before_sending(fake: RunningServer) -> None:
    hint = session("S").pin(ttl=5)
    with client_for(fake) as kv:
        result = kv.apply(hint)
    sent = fake.servicer.applied[0].hint_id
    assert len(sent) == 36 and result.hints[0].hint_id == sent == result[0].hint_id
    assert hint.hint_id == "", "the caller's hint is not modified"


def test_unavailable_is_retried_until_success(fake: RunningServer) -> None:
    fake.servicer.fail_next["ApplyHints"] = [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE]
    with client_for(fake) as kv:
        result = kv.apply(session("S").pin(ttl=5))
    assert fake.servicer.count("ApplyHints") == 3
    assert result.all_accepted


def test_retry_after_lost_reply_replays_through_the_assigned_hint_id(fake: RunningServer) -> None:
    fake.servicer.apply_then_fail = grpc.StatusCode.UNAVAILABLE  # applied, but the reply is lost
    with client_for(fake) as kv:
        result = kv.apply(session("S").pin(ttl=5))
    assert fake.servicer.count("ApplyHints") == 2
    assert len(fake.servicer.applied) == 1, "the hint was applied once"
    assert result[0].replayed and result.all_accepted


def test_retries_stop_after_max_attempts(fake: RunningServer) -> None:
    fake.servicer.fail_next["GetCapabilities"] = [grpc.StatusCode.UNAVAILABLE] * 10
    with client_for(fake) as kv, pytest.raises(KvHintError) as info:
        kv.capabilities()
    assert info.value.code == grpc.StatusCode.UNAVAILABLE and info.value.is_unavailable
    assert fake.servicer.count("GetCapabilities") == FAST_RETRY.max_attempts


@pytest.mark.parametrize(
    "code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL, grpc.StatusCode.RESOURCE_EXHAUSTED,
             grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNKNOWN],
)
def test_other_codes_are_not_retried(fake: RunningServer, code: grpc.StatusCode) -> None:
    fake.servicer.fail_next["ListSessions"] = [code, code]
    with client_for(fake) as kv, pytest.raises(KvHintError) as info:
        kv.list_sessions()
    assert info.value.code == code
    assert fake.servicer.count("ListSessions") == 1


def test_deadline_exceeded_is_not_retried(fake: RunningServer) -> None:
    fake.servicer.delay["GetCapabilities"] = 0.5
    with client_for(fake) as kv, pytest.raises(KvHintError) as info:
        kv.capabilities(timeout=0.1)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and info.value.is_unavailable
    assert info.value.method == "GetCapabilities"
    assert fake.servicer.count("GetCapabilities") == 1


def test_connection_refused_surfaces_as_unavailable() -> None:
    config = ConnectionConfig(address="127.0.0.1:1", retry=RetryPolicy(max_attempts=2, initial_backoff=0.01, jitter=0))
    with KvHintClient(config) as kv, pytest.raises(KvHintError) as info:
        kv.health()
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert info.value.address == "127.0.0.1:1"


# -- errors -----------------------------------------------------------------------------------------


def test_invalid_argument_carries_error_info(fake: RunningServer) -> None:
    fake.servicer.abort["ApplyHints"] = (
        grpc.StatusCode.INVALID_ARGUMENT, "batch of 600 hints exceeds 512", "REASON_TOO_MANY_HINTS", {"field": "hints"})
    with client_for(fake) as kv, pytest.raises(KvHintError) as info:
        kv.apply(session("S").pin(ttl=1))
    error = info.value
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert (error.reason, error.domain, error.field) == ("REASON_TOO_MANY_HINTS", "kvhint.v1", "hints")
    assert error.details == "batch of 600 hints exceeds 512"
    assert "reason=REASON_TOO_MANY_HINTS" in str(error) and "field=hints" in str(error)
    assert fake.servicer.count("ApplyHints") == 1


def test_error_survives_pickling() -> None:
    import pickle

    error = KvHintError(grpc.StatusCode.INVALID_ARGUMENT, "bad", reason="REASON_INVALID_HINT", domain="kvhint.v1",
                        metadata={"field": "hints[0]"}, method="ApplyHints", address="h:1")
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.code, copy.reason, copy.field, copy.method, str(copy)) == (
        error.code, error.reason, "hints[0]", "ApplyHints", str(error))


def test_an_overload_error_keeps_its_retry_after_through_pickling() -> None:
    """A router handing errors between processes still knows when to retry."""
    import pickle

    from google.protobuf import any_pb2, duration_pb2
    from google.rpc import error_details_pb2

    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=2, nanos=500_000_000)))
    error = KvHintError(grpc.StatusCode.RESOURCE_EXHAUSTED, "rate limited", method="ApplyHints", status_details=[detail])
    assert error.retry_after == 2.5
    copy = pickle.loads(pickle.dumps(error))
    assert copy.retry_after == 2.5 and copy.is_overloaded and str(copy) == str(error)


def test_unknown_operation_is_not_found(fake: RunningServer) -> None:
    with client_for(fake) as kv, pytest.raises(KvHintError) as info:
        kv.get_operation("nope")
    assert info.value.code == grpc.StatusCode.NOT_FOUND and info.value.reason is None


def test_error_without_details_has_no_error_info(fake: RunningServer) -> None:
    fake.servicer.fail_next["QueryResidency"] = [grpc.StatusCode.INTERNAL]
    with client_for(fake) as kv, pytest.raises(KvHintError) as info:
        kv.query_residency(session("S"))
    assert info.value.reason is None and info.value.metadata == {}


# -- metadata, pagination, operations, health, watch ------------------------------------------------------


def test_bearer_token_and_extra_metadata_are_sent(fake: RunningServer) -> None:
    with client_for(fake, bearer_token="s3cret", metadata=(("x-tenant", "t1"),)) as kv:
        kv.capabilities()
    seen = fake.servicer.metadata_seen[-1]
    assert seen["authorization"] == "Bearer s3cret" and seen["x-tenant"] == "t1"


def test_query_residency_follows_every_page(fake: RunningServer) -> None:
    fake.servicer.blocks = [
        kvhint_pb2.BlockInfo(block_hash=bytes([i]), position=i, tiers=[kvhint_pb2.TIER_DEVICE]) for i in range(5)
    ]
    with client_for(fake) as kv:
        residency = kv.query_residency(session("S"), page_size=2)
        page = kv.query_residency_page(session("S"), page_size=2)
    assert residency.pages == 3 and residency.hashes() == [bytes([i]) for i in range(5)]
    assert residency.totals == {kvhint_pb2.TIER_DEVICE: 5} and residency.as_of_epoch == "E1"
    assert len(page.blocks) == 2 and page.next_page_token == "2"


def test_list_sessions_follows_pages_and_prefix(fake: RunningServer) -> None:
    fake.servicer.sessions = [kvhint_pb2.SessionInfo(session_id=s) for s in ("b1", "a2", "a1", "a3")]
    with client_for(fake) as kv:
        sessions = kv.list_sessions(prefix="a", page_size=1)
    assert [s.session_id for s in sessions] == ["a1", "a2", "a3"]
    assert fake.servicer.count("ListSessions") == 3


def test_wait_operation_polls_until_final_state(fake: RunningServer) -> None:
    running, done = kvhint_pb2.Operation.STATE_RUNNING, kvhint_pb2.Operation.STATE_SUCCEEDED
    fake.servicer.operations["op1"] = [running, running, done]
    with client_for(fake) as kv:
        op = kv.wait_operation("op1", timeout=5, poll_interval=0.01)
    assert op.state == done and fake.servicer.count("GetOperation") == 3


def test_wait_operation_times_out_with_deadline_exceeded(fake: RunningServer) -> None:
    fake.servicer.operations["op2"] = [kvhint_pb2.Operation.STATE_RUNNING]
    with client_for(fake) as kv, pytest.raises(KvHintError) as info:
        kv.wait_operation("op2", timeout=0.2, poll_interval=0.05)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "STATE_RUNNING" in info.value.details


@pytest.mark.parametrize("timeout", [math.inf, math.nan, 1e10, 0.0])
def test_a_timeout_grpc_cannot_honour_is_refused_before_sending(fake: RunningServer, timeout: float) -> None:
    """timeout=inf or 1e10 used to fail DEADLINE_EXCEEDED without sending (gRPC's deadline
    overflows); nan was sent with no deadline. Now: ValueError naming the argument, nothing sent."""
    message = r"timeout must be a finite number of seconds > 0 and at most 2147483648"
    with client_for(fake) as kv:
        with pytest.raises(ValueError, match=message):
            kv.apply(session("S").evict(), timeout=timeout)
        with pytest.raises(ValueError, match=message):
            kv.watch("now", timeout=timeout)

    async def scenario() -> None:
        async with AsyncKvHintClient(ConnectionConfig(address=fake.address, retry=FAST_RETRY)) as kv:
            with pytest.raises(ValueError, match=message):
                await kv.apply(session("S").evict(), timeout=timeout)
            with pytest.raises(ValueError, match=message):
                kv.watch("now", timeout=timeout)

    asyncio.run(scenario())
    assert fake.servicer.count("ApplyHints") == 0 and fake.servicer.count("WatchEvents") == 0


def test_the_longest_timeout_is_sent(fake: RunningServer) -> None:
    with client_for(fake) as kv:
        assert kv.apply(session("S").evict(), timeout=2.0**31).all_accepted


def test_an_endless_wait_without_a_default_timeout_polls(fake: RunningServer) -> None:
    """wait_operation(timeout=inf) with default_timeout=None: each poll gets a deadline gRPC can
    honour (it used to get inf, and fail DEADLINE_EXCEEDED unsent)."""
    fake.servicer.operations["op3"] = [kvhint_pb2.Operation.STATE_RUNNING, kvhint_pb2.Operation.STATE_SUCCEEDED]
    with client_for(fake, default_timeout=None) as kv:
        op = kv.wait_operation("op3", timeout=math.inf, poll_interval=0.01)
    assert op.state == kvhint_pb2.Operation.STATE_SUCCEEDED

    async def scenario() -> kvhint_pb2.Operation:
        config = ConnectionConfig(address=fake.address, retry=FAST_RETRY, default_timeout=None)
        async with AsyncKvHintClient(config) as kv:
            return await kv.wait_operation("op4", timeout=math.inf, poll_interval=0.01)

    fake.servicer.operations["op4"] = [kvhint_pb2.Operation.STATE_RUNNING, kvhint_pb2.Operation.STATE_FAILED]
    assert asyncio.run(scenario()).state == kvhint_pb2.Operation.STATE_FAILED


def test_health_reports_both_services(fake: RunningServer) -> None:
    with client_for(fake) as kv:
        assert kv.health().serving
        from grpc_health.v1 import health_pb2

        fake.health.set("kvhint.v1.KvHintService", health_pb2.HealthCheckResponse.NOT_SERVING)
        report = kv.health()
    assert not report.serving
    assert report.statuses == {"kvhint.v1.KvHintService": "NOT_SERVING", "": "SERVING"}


def test_watch_streams_messages_and_cancel_ends_quietly(fake: RunningServer) -> None:
    fake.servicer.watch_scripts = [[stored("E1", 1, [1], "S"), heartbeat("E1", 1), HANG]]
    with client_for(fake) as kv:
        stream = kv.watch("snapshot", heartbeat=0.5)
        received = []
        for message in stream:
            received.append(message.WhichOneof("payload"))
            if len(received) == 2:
                threading.Timer(0.05, stream.cancel).start()
    assert received == ["blocks_stored", "heartbeat"]
    request = fake.servicer.watch_requests[0]
    assert request.start == kvhint_pb2.WatchEventsRequest.START_SNAPSHOT
    assert request.heartbeat_interval.nanos == 500_000_000


def test_watch_resume_request_and_stream_error(fake: RunningServer) -> None:
    fake.servicer.watch_scripts = [[("abort", grpc.StatusCode.UNAVAILABLE)]]
    with client_for(fake) as kv:
        stream = kv.watch(resume=("E9", 41))
        with pytest.raises(KvHintError) as info:
            list(stream)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE and info.value.method == "WatchEvents"
    request = fake.servicer.watch_requests[0]
    assert (request.start, request.resume_epoch, request.resume_after_sequence) == (
        kvhint_pb2.WatchEventsRequest.START_RESUME, "E9", 41)


def test_watch_rejects_inconsistent_start() -> None:
    with KvHintClient("127.0.0.1:1") as kv:
        with pytest.raises(ValueError, match="needs resume"):
            kv.watch("resume")
        with pytest.raises(ValueError, match="only valid with start=resume"):
            kv.watch("snapshot", resume=("E", 1))


def test_apply_envelope_lowers_and_applies(fake: RunningServer) -> None:
    envelope = {"protocol_version": "0.1", "message_id": "m", "actions": [
        {"action_id": "a1", "action_type": "kv.pin", "action_version": "1.0",
         "payload": {"selector": {"session_id": "S"}, "ttl_seconds": 3}}]}
    with client_for(fake) as kv:
        result = kv.apply_envelope(envelope)
    assert result.all_accepted and fake.servicer.applied[0].hint_id == "a1"
    assert fake.servicer.applied[0].pin.ttl.seconds == 3


# -- asyncio client ---------------------------------------------------------------------------------


def test_async_client_same_surface(fake: RunningServer) -> None:
    fake.servicer.fail_next["ApplyHints"] = [grpc.StatusCode.UNAVAILABLE]
    fake.servicer.blocks = [kvhint_pb2.BlockInfo(block_hash=bytes([i]), tiers=[1]) for i in range(3)]
    fake.servicer.watch_scripts = [[stored("E1", 7, [1], "S"), HANG]]
    fake.servicer.operations["op"] = [kvhint_pb2.Operation.STATE_RUNNING, kvhint_pb2.Operation.STATE_FAILED]

    async def scenario() -> None:
        async with AsyncKvHintClient(ConnectionConfig(address=fake.address, retry=FAST_RETRY)) as kv:
            caps = await kv.capabilities()
            assert caps.engine == "fake"
            result = await kv.apply(session("S").pin(ttl=1), blocks(b"x").evict())
            assert result.all_accepted and len(result) == 2
            assert fake.servicer.count("ApplyHints") == 2
            residency = await kv.query_residency(session("S"), page_size=2)
            assert residency.pages == 2 and len(residency.blocks) == 3
            assert (await kv.health()).serving
            op = await kv.wait_operation("op", timeout=5, poll_interval=0.01)
            assert op.state == kvhint_pb2.Operation.STATE_FAILED
            with pytest.raises(KvHintError) as info:
                await kv.get_operation("missing")
            assert info.value.code == grpc.StatusCode.NOT_FOUND
            stream = kv.watch("snapshot")
            async for message in stream:
                assert message.sequence == 7
                stream.cancel()
            fake.servicer.abort["ListSessions"] = (grpc.StatusCode.INVALID_ARGUMENT, "bad prefix",
                                                   "REASON_MALFORMED_REQUEST", {"field": "session_id_prefix"})
            with pytest.raises(KvHintError) as info:
                await kv.list_sessions(prefix="x")
            assert info.value.reason == "REASON_MALFORMED_REQUEST" and info.value.field == "session_id_prefix"

    asyncio.run(scenario())
