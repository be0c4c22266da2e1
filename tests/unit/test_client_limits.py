"""The typed client takes id and batch limits from the server (GetCapabilities), not from
copies of the defaults; and UNAVAILABLE says why (engine stopped vs no step boundary)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import grpc
import pytest
from kvhint_unit_support import Harness, error_info, h, pin

from kvhint.v1 import kvhint_pb2 as pb
from kvhint_client import AsyncKvHintClient, KvHintClient
from kvhint_client.builders import session
from kvhint_client.fleet import FleetClient


def test_client_checks_the_servers_limits_once_known(make_harness: Callable[..., Harness]) -> None:
    harness = make_harness(max_id_length=8, max_hint_id_length=40, max_hints_per_batch=2, max_block_hashes_per_batch=5)
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
            ((hashes_pin(3), hashes_pin(3)), r"hints\[:2\] hold 6 block hashes; the server takes at most 5 per batch"),
        ]
        for hints, message in cases:
            with pytest.raises(ValueError, match=message):
                kv.apply(*hints)
        assert kv.apply(session("s" * 8).pin(ttl=5, hint_id="h" * 40))[0].hint_id == "h" * 40


def hashes_pin(n: int) -> pb.Hint:
    return pb.Hint(selector=pb.Selector(block_hashes=pb.BlockHashSelector(block_hashes=[h(i) for i in range(n)])),
                   pin=pb.PinAction(ttl={"seconds": 5}))


def test_ids_longer_than_the_default_go_through_when_the_server_allows_them(make_harness: Callable[..., Harness]) -> None:
    harness = make_harness(max_id_length=1024)
    with KvHintClient(f"127.0.0.1:{harness.port}") as kv:
        kv.capabilities()
        (result,) = kv.apply(session("s" * 600).release())
        assert result.hint_id  # answered by the server, not refused by a client-side 256-byte copy


def test_ids_the_client_assigns_fit_the_servers_hint_id_limit(make_harness: Callable[..., Harness]) -> None:
    """A server whose max_hint_id_length is under a uuid4's 36 bytes: once its limits are known,
    the ids apply() gives hints without one fit them (a 36-byte uuid4 made every such hint
    REJECTED/INVALID_HINT, "hint_id is longer than 16 bytes"). Both clients, distinct ids."""
    harness = make_harness(max_hint_id_length=16)
    harness.engine.store([h(1), h(2)], session="S")
    address = f"127.0.0.1:{harness.port}"
    with KvHintClient(address) as kv:
        kv.capabilities()
        result = kv.apply(session("S").retain(ttl=5), session("S").pin(ttl=5))

    async def scenario():
        async with AsyncKvHintClient(address) as kv:
            await kv.capabilities()
            return await kv.apply(session("S").retain(ttl=5), session("S").pin(ttl=5))

    for applied in (result, asyncio.run(scenario())):
        assert [r.reason for r in applied] == [pb.REASON_UNSPECIFIED] * 2, [r.message for r in applied]
        assert applied.all_applied
        ids = [hint.hint_id for hint in applied.hints]
        assert all(1 <= len(i.encode("utf-8")) <= 16 for i in ids) and len(set(ids)) == 2
        assert [r.hint_id for r in applied] == ids


def test_ids_a_fleet_gives_fit_the_shortest_hint_id_limit_it_read(make_harness: Callable[..., Harness]) -> None:
    """FleetClient gives an id to each hint without one, the same id on every engine it routes
    to: once an engine's limits were read, the id fits its max_hint_id_length (a uuid4 made
    apply() raise ValueError, "hint_id is 36 bytes", before sending anything)."""
    harness = make_harness(max_hint_id_length=12)
    harness.engine.store([h(1), h(2)], session="S")
    with FleetClient({"e": f"127.0.0.1:{harness.port}"}) as fleet:
        fleet.client("e").capabilities()
        out = fleet.apply(session("S").retain(ttl=5), session("S").pin(ttl=5), timeout=5)
    assert out.all_accepted, out
    ids = list(out.routes)
    assert len(ids) == 2 and all(1 <= len(i) <= 12 for i in ids) and out.routes == {i: ["e"] for i in ids}


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


@pytest.mark.parametrize("ends", ["client cancels", "deadline passes"])
def test_a_batch_the_caller_gave_up_on_before_the_engine_took_it_is_never_applied(
    make_harness: Callable[..., Harness], ends: str
) -> None:
    """The batch waits for the engine thread (busy here). When the call ends first, by the
    client's cancellation or its deadline (gRPC cancels the handler, or the server's own bound
    answers UNAVAILABLE), the queued batch is withdrawn: the Pin must not take effect later,
    after the caller was told it failed."""
    harness = make_harness()
    harness.engine.store([h(1), h(2)], session="s1")
    for trial in range(4):
        gate = threading.Event()
        harness.core.submit(lambda: gate.wait(5))  # no step boundary until the gate opens
        request = pb.ApplyHintsRequest(hints=[pin("s1", 60, hint_id=f"p{trial}")])
        if ends == "client cancels":
            call = harness.stub.ApplyHints.future(request, timeout=30)
            time.sleep(0.3)
            assert call.cancel()
        else:
            with pytest.raises(grpc.RpcError) as info:
                harness.stub.ApplyHints(request, timeout=0.3)
            assert info.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
        time.sleep(0.1)  # the server's handler sees the end of the call
        gate.set()
        owners = harness.engine.run(lambda: {o for x in (h(1), h(2)) for o in harness.core.ledger.owners(x)})
        assert owners == set(), f"trial {trial}: the abandoned Pin took effect ({owners})"
