"""Tenancy over real gRPC on loopback with the fake engine: two tenants and an
admin (kvhint_server/tenancy.py, kvhint_server/tenant_guard.py)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from kvhint.v1 import kvhint_pb2 as pb
from kvhint_server.config import ConfigError, ServerConfig
from kvhint_server.metrics import KvHintMetrics, MetricsExporter

from kvhint_unit_support import Harness, error_info, h, local_engine_info, pin, retain, session_sel, tiered_engine_info

TENANTS = {
    "tenants": [
        {"name": "team-a", "session_prefix": "a/", "tokens": ["tok-a"], "pin_budget_blocks": 6, "retention_budget_blocks": 8},
        {"name": "team-b", "session_prefix": "b/", "tokens": ["tok-b", "tok-b2"], "pin_budget_blocks": 2,
         "retention_budget_blocks": 3},
        {"name": "ops", "role": "admin", "tokens": ["tok-admin"]},
    ]
}
A, B, ADMIN = (("authorization", "Bearer tok-a"),), (("authorization", "Bearer tok-b2"),), (("authorization", "Bearer tok-admin"),)


def write(tmp: Path, doc: object) -> str:
    path = tmp / "tenants.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(path)


@pytest.fixture
def hx(tmp_path: Path) -> Iterator[Harness]:
    harness = Harness(local_engine_info(num_device_blocks=64), tenants_file=write(tmp_path, TENANTS))
    try:
        yield harness
    finally:
        harness.close()


def apply(hx: Harness, who, *hints: pb.Hint) -> list[pb.HintResult]:
    return list(hx.stub.ApplyHints(pb.ApplyHintsRequest(hints=list(hints)), metadata=who, timeout=10).results)


def evict(sel: pb.Selector, hint_id: str = "") -> pb.Hint:
    return pb.Hint(hint_id=hint_id, selector=sel, evict=pb.EvictAction())


def release(sel: pb.Selector) -> pb.Hint:
    return pb.Hint(selector=sel, release=pb.ReleaseAction())


def hashes_sel(*hs: bytes) -> pb.Selector:
    return pb.Selector(block_hashes=pb.BlockHashSelector(block_hashes=list(hs)))


def device_of(hx: Harness, who, sel: pb.Selector) -> list[pb.BlockInfo]:
    r = hx.stub.QueryResidency(pb.QueryResidencyRequest(selector=sel), metadata=who, timeout=10)
    return [b for b in r.blocks if pb.TIER_DEVICE in b.tiers]


def sessions(hx: Harness, who, prefix: str = "") -> list[str]:
    r = hx.stub.ListSessions(pb.ListSessionsRequest(session_id_prefix=prefix), metadata=who, timeout=10)
    return [s.session_id for s in r.sessions]


def grants_of(hx: Harness, prefix: str) -> dict[bytes, dict[str, object]]:
    """Every retention grant held for sessions/continuations in `prefix` (engine thread)."""
    def read() -> dict[bytes, dict[str, object]]:
        return {
            blk: {o: g for o, g in per.items() if o[2:].startswith(prefix)}
            for blk, per in hx.core.ledger.grants.items()
            if any(o[2:].startswith(prefix) for o in per)
        }
    return hx.engine.run(read)


def outcome(r: pb.HintResult) -> tuple[str, str]:
    return pb.Outcome.Name(r.outcome), pb.Reason.Name(r.reason)


# ---------------------------------------------------------------- authentication


def test_unknown_or_missing_token_is_unauthenticated_and_health_stays_open(hx: Harness) -> None:
    for md in ((("authorization", "Bearer nope"),), ()):
        with pytest.raises(grpc.RpcError) as err:
            hx.stub.ListSessions(pb.ListSessionsRequest(), metadata=md, timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    reply = health_pb2_grpc.HealthStub(hx.channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert sessions(hx, B) == []  # the second token of team-b works


# ---------------------------------------------------------------- cross-tenant hints


def test_team_b_cannot_evict_or_release_team_a_pinned_session(hx: Harness) -> None:
    blocks = [h(i) for i in range(1, 5)]
    hx.engine.store(blocks, session="a/s1")
    assert outcome(apply(hx, A, pin("a/s1", 60))[0]) == ("OUTCOME_ACCEPTED", "REASON_UNSPECIFIED")
    before = grants_of(hx, "a/")
    for hint in (evict(session_sel("a/s1")), release(session_sel("a/s1")), retain("a/s1", 5), pin("a/s1", 5),
                 evict(pb.Selector(continuation=pb.ContinuationSelector(continuation_id="a/c")))):
        result = apply(hx, B, hint)[0]
        assert outcome(result) == ("OUTCOME_REJECTED", "REASON_PERMISSION_DENIED"), result
        assert "team-b" in result.message
    # Explicit hashes of A's blocks select nothing for B.
    for hint in (evict(hashes_sel(*blocks)), release(hashes_sel(*blocks))):
        assert outcome(apply(hx, B, hint)[0]) == ("OUTCOME_MISSING", "REASON_NOT_RESIDENT")
    assert all(x in hx.engine.device for x in blocks)
    assert grants_of(hx, "a/") == before
    assert sessions(hx, A) == ["a/s1"]
    assert len(device_of(hx, A, session_sel("a/s1"))) == 4


def test_shared_content_is_clipped_not_evicted(hx: Harness) -> None:
    shared = [h(1), h(2), h(3)]
    hx.engine.store(shared, session="a/x")
    hx.engine.store(shared, session="b/y", prefix_hit=True)
    hx.engine.store([h(10)], session="b/y", first_position=3, parent=h(3))
    result = apply(hx, B, evict(session_sel("b/y")))[0]
    assert outcome(result) == ("OUTCOME_CLIPPED", "REASON_PERMISSION_DENIED"), result
    assert [(c.requested_blocks, c.granted_blocks) for c in result.clips if c.reason == pb.REASON_PERMISSION_DENIED] == [(4, 1)]
    assert h(10) not in hx.engine.device and all(x in hx.engine.device for x in shared)
    # Demote-like effects of Release: B's release of its session leaves A's shared blocks where they are.
    assert outcome(apply(hx, B, release(session_sel("b/y")))[0])[0] in ("OUTCOME_ACCEPTED", "OUTCOME_MISSING")
    assert all(x in hx.engine.device for x in shared) and not set(shared) & set(hx.engine.demoted_first)
    # A, owning every member, may evict them.
    assert outcome(apply(hx, A, evict(session_sel("a/x")))[0]) == ("OUTCOME_ACCEPTED", "REASON_UNSPECIFIED")


def test_a_block_another_tenant_retains_is_not_evicted(hx: Harness) -> None:
    hx.engine.store([h(1), h(2)], session="a/x")
    assert outcome(apply(hx, A, retain("a/x", 60))[0])[0] == "OUTCOME_ACCEPTED"
    hx.engine.run(lambda: hx.core.index.forget_session("a/x"))  # no membership left, only A's grant
    hx.engine.store([h(1), h(2)], session="b/y", prefix_hit=True)
    result = apply(hx, B, evict(session_sel("b/y")))[0]
    assert outcome(result) == ("OUTCOME_CLIPPED", "REASON_PERMISSION_DENIED")
    assert h(1) in hx.engine.device and h(2) in hx.engine.device


def test_hint_ids_are_scoped_per_tenant(hx: Harness) -> None:
    hx.engine.store([h(1)], session="a/x")
    hx.engine.store([h(2)], session="b/y")
    first = apply(hx, A, retain("a/x", 30, hint_id="same"))[0]
    other = apply(hx, B, retain("b/y", 60, hint_id="same"))[0]
    assert not other.replayed and outcome(other) == ("OUTCOME_ACCEPTED", "REASON_UNSPECIFIED")
    again = apply(hx, A, retain("a/x", 30, hint_id="same"))[0]
    assert again.replayed and outcome(again) == outcome(first)


# ---------------------------------------------------------------- queries and events


def test_lists_and_queries_see_only_own_sessions(hx: Harness) -> None:
    hx.engine.store([h(1), h(2)], session="a/x")
    hx.engine.store([h(1), h(2)], session="b/y", prefix_hit=True)
    hx.engine.store([h(3)], session="b/z")
    assert sessions(hx, B) == ["b/y", "b/z"]
    assert sessions(hx, B, "a/") == [] and sessions(hx, B, "b/z") == ["b/z"]
    assert sessions(hx, A) == ["a/x"]
    assert sessions(hx, ADMIN) == ["a/x", "b/y", "b/z"]
    with pytest.raises(grpc.RpcError) as err:
        device_of(hx, B, session_sel("a/x"))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    info = error_info(err.value)
    assert info is not None and info.reason == "REASON_PERMISSION_DENIED"
    assert info.metadata["field"] == "selector.session.session_id"
    shared = device_of(hx, B, hashes_sel(h(1), h(2), h(3)))
    assert [b.block_hash for b in shared] == [h(1), h(3), h(2)]  # chain positions 0, 0, 1
    assert all(set(b.session_ids) <= {"b/y", "b/z"} and b.session_ids for b in shared)
    assert {s for b in device_of(hx, ADMIN, hashes_sel(h(1))) for s in b.session_ids} == {"a/x", "b/y"}
    # A's exclusive block is invisible to B even by hash.
    hx.engine.store([h(9)], session="a/only")
    assert device_of(hx, B, hashes_sel(h(9))) == []


def test_a_block_shared_past_the_member_cap_lists_the_tenants_own_sessions(hx: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """BlockInfo.session_ids lists at most a cap of members (16; 2 here). A tenant's view is cut to
    its own sessions: the cap must not be filled by another tenant's sessions first, leaving the
    tenant's own blocks listed with none of its sessions."""
    from kvhint_server import index as index_module
    from kvhint_server import queries as queries_module

    monkeypatch.setattr(index_module, "MAX_MEMBERS_REPORTED", 2)
    monkeypatch.setattr(queries_module, "MAX_MEMBERS_REPORTED", 2)
    hx.engine.store([h(1), h(2)], session="a/0")
    for i in range(1, 200):
        hx.engine.store([h(1), h(2)], session=f"a/{i}", prefix_hit=True)
    for s in ("b/y", "b/z"):
        hx.engine.store([h(1), h(2)], session=s, prefix_hit=True)
    for sel in (session_sel("b/y"), hashes_sel(h(1), h(2))):
        assert [(b.block_hash, list(b.session_ids)) for b in device_of(hx, B, sel)] == [
            (h(1), ["b/y", "b/z"]), (h(2), ["b/y", "b/z"])]
    assert all(len(b.session_ids) == 2 for b in device_of(hx, ADMIN, session_sel("b/y")))


def _watch(hx: Harness, who, into: list[pb.WatchEventsResponse], stop: threading.Event, **req) -> threading.Thread:
    call = hx.stub.WatchEvents(pb.WatchEventsRequest(**req), metadata=who, timeout=20)

    def run() -> None:
        try:
            for msg in call:
                into.append(msg)
                if stop.is_set():
                    break
        except grpc.RpcError:
            pass
        finally:
            call.cancel()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_watch_events_carry_only_own_sessions(hx: Harness) -> None:
    hx.engine.store([h(1)], session="a/old")
    got_b: list[pb.WatchEventsResponse] = []
    got_admin: list[pb.WatchEventsResponse] = []
    stop = threading.Event()
    tb = _watch(hx, B, got_b, stop, start=pb.WatchEventsRequest.START_SNAPSHOT)
    ta = _watch(hx, ADMIN, got_admin, stop, start=pb.WatchEventsRequest.START_NOW)
    hx.wait_subscribers(2)
    hx.engine.store([h(2), h(3)], session="a/x")
    hx.engine.store([h(2), h(3)], session="b/y", prefix_hit=True)
    hx.engine.store([h(4)], session="a/z")
    apply(hx, A, evict(session_sel("a/z")))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and sum(m.HasField("blocks_removed") for m in got_admin) < 1:
        time.sleep(0.02)
    time.sleep(0.2)
    stop.set()
    hx.engine.store([h(5)], session="b/end")  # wakes both streams so they see `stop`
    tb.join(5)
    ta.join(5)
    text_b = b"".join(m.SerializeToString() for m in got_b)
    assert b"a/" not in text_b, [m for m in got_b if b"a/" in m.SerializeToString()]
    stored_b = [m.blocks_stored for m in got_b if m.HasField("blocks_stored")]
    assert any(s.coordinates.session_id == "b/y" for s in stored_b)
    assert not any(m.HasField("blocks_removed") for m in got_b)  # only A's block went
    assert b"a/x" in b"".join(m.SerializeToString() for m in got_admin)
    assert any(m.HasField("snapshot_end") for m in got_b)
    with pytest.raises(grpc.RpcError) as err:
        next(iter(hx.stub.WatchEvents(pb.WatchEventsRequest(filter=pb.EventFilter(session_ids=["b/y", "a/x"])),
                                      metadata=B, timeout=5)))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert error_info(err.value).metadata["field"] == "filter.session_ids[1]"


def test_removal_of_a_widely_shared_block_reaches_the_tenant_stream(hx: Harness) -> None:
    """Removals name at most 16 member sessions; a block B saw stored must still be
    reported removed on B's stream when the 16 named are all A's."""
    got_b: list[pb.WatchEventsResponse] = []
    stop = threading.Event()
    tb = _watch(hx, B, got_b, stop, start=pb.WatchEventsRequest.START_NOW)
    hx.wait_subscribers(1)
    for i in range(200):
        hx.engine.store([h(1)], session=f"a/{i:03d}", prefix_hit=i > 0)
    hx.engine.store([h(1)], session="b/y", prefix_hit=True)  # 1 of 201 members; the event names 16
    hx.engine.store([h(2)], session="a/only")
    hx.engine.remove([h(2)])  # never B's: not on B's stream
    hx.engine.remove([h(1)])
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not any(m.HasField("blocks_removed") for m in got_b):
        time.sleep(0.02)
    stop.set()
    hx.engine.store([h(5)], session="b/end")  # wakes the stream so it sees `stop`
    tb.join(5)
    removed = [bytes(x) for m in got_b if m.HasField("blocks_removed") for x in m.blocks_removed.block_hashes]
    assert removed == [h(1)]
    assert b"a/" not in b"".join(m.SerializeToString() for m in got_b)


# ---------------------------------------------------------------- budgets and metrics


def test_pin_and_retention_budgets_clip(hx: Harness) -> None:
    hx.engine.store([h(i) for i in range(1, 6)], session="b/big")
    result = apply(hx, B, pin("b/big", 60))[0]
    assert outcome(result) == ("OUTCOME_CLIPPED", "REASON_PIN_BUDGET")
    assert [(c.requested_blocks, c.granted_blocks) for c in result.clips] == [(5, 2)]
    result = apply(hx, B, retain("b/big", 60))[0]  # 2 pinned + 1 more fits the retention budget of 3
    assert outcome(result) == ("OUTCOME_CLIPPED", "REASON_RESOURCE_EXHAUSTED")
    assert [(c.requested_blocks, c.granted_blocks) for c in result.clips] == [(5, 3)]
    assert len(grants_of(hx, "b/")) == 3
    # Budgets are per tenant: A is not affected by B's use.
    hx.engine.store([h(i) for i in range(20, 26)], session="a/big")
    assert outcome(apply(hx, A, pin("a/big", 60))[0]) == ("OUTCOME_ACCEPTED", "REASON_UNSPECIFIED")
    # Metrics: per-tenant use, labelled by tenant name (never a session id).
    registry = CollectorRegistry()
    metrics = KvHintMetrics(registry)
    MetricsExporter(hx.core, metrics, tenant_usage=hx.server._tenant_usage).poll()
    value = registry.get_sample_value
    # The Retain replaced the session's own two pins (one grant per owner and block).
    assert value("kvhint_tenant_budget_used_blocks", {"tenant": "team-b", "budget": "pin"}) == 0
    assert value("kvhint_tenant_budget_used_blocks", {"tenant": "team-b", "budget": "retention"}) == 3
    assert value("kvhint_tenant_budget_used_blocks", {"tenant": "team-a", "budget": "pin"}) == 6
    assert value("kvhint_tenant_budget_blocks", {"tenant": "team-b", "budget": "retention"}) == 3
    assert "b/big" not in str([s for m in registry.collect() for s in m.samples])


_BUDGET_ACTIONS = st.sampled_from(["retain", "pin", "release", "evict"])


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(_BUDGET_ACTIONS, st.sampled_from(["b/1", "b/2", "b/3"])), min_size=2, max_size=6),
       st.sampled_from([1, 3, 10]))
@example(hints=[("pin", "b/1"), ("retain", "b/1"), ("pin", "b/2")], engine_pin_budget=10)  # a Retain replacing its own Pin frees pin budget
@example(hints=[("pin", "b/1"), ("retain", "b/2")], engine_pin_budget=1)  # a Pin the engine-wide budget clipped counts what it got
def test_a_tenants_batch_spends_its_budgets_as_the_same_hints_one_batch_each(tmp_path_factory, hints, engine_pin_budget) -> None:
    """"Applied in order": within one batch, a Release or Evict that ends some of B's grants
    gives the budget back to the Retain or Pin after it, and a Pin clipped by the engine-wide
    pin budget spends only what it was granted, exactly as when each hint is its own batch (pin
    budget 2, retention budget 3 blocks; three sessions of 2 blocks each; an engine-wide pin
    budget of 1, 3 or 10 blocks)."""
    def run(batched: bool) -> tuple[object, ...]:
        hx = Harness(local_engine_info(num_device_blocks=11), tenants_file=write(tmp_path_factory.mktemp("t"), TENANTS),
                     pin_budget_fraction=engine_pin_budget / 10)
        try:
            for i, s in enumerate(("b/1", "b/2", "b/3")):
                hx.engine.store([h(10 * i + 1), h(10 * i + 2)], session=s)
            wire = [_hint(a, session_sel(s)) for a, s in hints]
            assert hx.core.ledger.pin_budget_blocks == engine_pin_budget
            results = apply(hx, B, *wire) if batched else [apply(hx, B, w)[0] for w in wire]
            return (
                [(outcome(r), [(c.requested_blocks, c.granted_blocks) for c in r.clips]) for r in results],
                {block: {owner: g.pinned for owner, g in per.items()} for block, per in grants_of(hx, "b/").items()},
            )
        finally:
            hx.close()

    assert run(batched=True) == run(batched=False)


def test_admin_sees_and_may_do_everything(hx: Harness) -> None:
    hx.engine.store([h(1), h(2)], session="a/x")
    hx.engine.store([h(1), h(2)], session="b/y", prefix_hit=True)
    assert len(device_of(hx, ADMIN, session_sel("a/x"))) == 2
    result = apply(hx, ADMIN, evict(session_sel("b/y")))[0]
    assert outcome(result) == ("OUTCOME_ACCEPTED", "REASON_UNSPECIFIED")
    assert h(1) not in hx.engine.device


def _payloads(got: list[pb.WatchEventsResponse], kind: str) -> list:
    return [getattr(m, kind) for m in got if m.WhichOneof("payload") == kind]


def test_an_operation_without_sessions_is_its_senders_alone(tmp_path: Path) -> None:
    """A Demote by continuation id names no session: only the tenant that sent it may read its
    operation (another tenant gets NOT_FOUND, as for a foreign session's operation), and its
    HintApplied and OperationCompleted reach that tenant's stream and no other tenant's."""
    hx = Harness(tiered_engine_info(num_device_blocks=64), tenants_file=write(tmp_path, TENANTS))
    try:
        hx.engine.store([h(1), h(2)], session="a/s1", continuation="a/c1")
        got_a: list[pb.WatchEventsResponse] = []
        got_b: list[pb.WatchEventsResponse] = []
        stop = threading.Event()
        threads = [_watch(hx, A, got_a, stop), _watch(hx, B, got_b, stop)]
        hx.wait_subscribers(2)
        sel = pb.Selector(continuation=pb.ContinuationSelector(continuation_id="a/c1"))
        result = apply(hx, A, pb.Hint(hint_id="a-demote", selector=sel, demote=pb.DemoteAction()))[0]
        assert result.outcome == pb.OUTCOME_DEFERRED and result.operation_id
        hx.core.operations.complete(result.operation_id, ok=True)
        read = lambda who: hx.stub.GetOperation(pb.GetOperationRequest(operation_id=result.operation_id), metadata=who, timeout=5)
        assert read(A).operation.hint_id == "a-demote"
        assert read(ADMIN).operation.hint_id == "a-demote"
        with pytest.raises(grpc.RpcError) as err:
            read(B)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not _payloads(got_a, "operation_completed"):
            time.sleep(0.02)
        stop.set()
        hx.engine.store([h(5)], session="a/end")  # wakes both streams so they see `stop`
        hx.engine.store([h(6)], session="b/end")
        for t in threads:
            t.join(5)
        assert [e.hint.hint_id for e in _payloads(got_a, "hint_applied")] == ["a-demote"]
        assert [e.operation.operation_id for e in _payloads(got_a, "operation_completed")] == [result.operation_id]
        assert not _payloads(got_b, "hint_applied") and not _payloads(got_b, "operation_completed")
    finally:
        hx.close()


def test_a_tenants_hints_reach_its_own_stream_and_never_another_tenants(hx: Harness) -> None:
    """A block-hash hint names no session: its HintApplied still reaches the sender. A hint on
    another tenant's session (REJECTED) is the sender's business, not the session owner's."""
    hx.engine.store([h(1)], session="a/x")
    hx.engine.store([h(2)], session="b/y")
    got_a: list[pb.WatchEventsResponse] = []
    got_b: list[pb.WatchEventsResponse] = []
    stop = threading.Event()
    threads = [_watch(hx, A, got_a, stop), _watch(hx, B, got_b, stop)]
    hx.wait_subscribers(2)
    results = apply(hx, A, evict(hashes_sel(h(1)), hint_id="by-hash"), evict(session_sel("b/y"), hint_id="probe"))
    assert [outcome(r)[0] for r in results] == ["OUTCOME_ACCEPTED", "OUTCOME_REJECTED"]
    assert [outcome(r) for r in apply(hx, ADMIN, evict(session_sel("b/y"), hint_id="admin-evict"))] == [
        ("OUTCOME_ACCEPTED", "REASON_UNSPECIFIED")]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (len(_payloads(got_a, "hint_applied")) < 2 or not _payloads(got_b, "hint_applied")):
        time.sleep(0.02)
    time.sleep(0.1)
    stop.set()
    hx.engine.store([h(5)], session="a/end")
    hx.engine.store([h(6)], session="b/end")
    for t in threads:
        t.join(5)
    assert [e.hint.hint_id for e in _payloads(got_a, "hint_applied")] == ["by-hash", "probe"]
    # B sees the admin's hint on its session (as before), not A's rejected probe of it.
    assert [e.hint.hint_id for e in _payloads(got_b, "hint_applied")] == ["admin-evict"]


# ---------------------------------------------------------------- randomized isolation


_ACTIONS = st.sampled_from(["retain", "pin", "release", "evict"])
_B_SELECTORS = st.one_of(
    st.sampled_from(["b/y", "b/z", "b/none", "a/x", "a/only", "other"]).map(session_sel),
    st.lists(st.integers(1, 12), min_size=1, max_size=6).map(lambda xs: hashes_sel(*[h(i) for i in xs])),
    st.sampled_from(["a/c", "b/c"]).map(lambda c: pb.Selector(continuation=pb.ContinuationSelector(continuation_id=c))),
)


def _hint(action: str, sel: pb.Selector) -> pb.Hint:
    from google.protobuf import duration_pb2

    ttl = duration_pb2.Duration(seconds=60)
    body = {"retain": {"retain": pb.RetainAction(ttl=ttl)}, "pin": {"pin": pb.PinAction(ttl=ttl)},
            "release": {"release": pb.ReleaseAction()}, "evict": {"evict": pb.EvictAction()}}[action]
    return pb.Hint(selector=sel, **body)


def test_random_batches_of_team_b_never_change_team_a(tmp_path: Path) -> None:
    hx = Harness(local_engine_info(num_device_blocks=64), tenants_file=write(tmp_path, TENANTS))
    try:
        hx.engine.store([h(1), h(2), h(3), h(4)], session="a/x", continuation="a/c")
        hx.engine.store([h(11), h(12)], session="a/only")
        apply(hx, A, pin("a/x", 600), retain("a/only", 600))

        def a_state() -> tuple[object, ...]:
            def read() -> tuple[object, ...]:
                index = hx.core.index
                return (
                    {s: sorted(index.sessions[s].blocks) for s in index.sessions if s.startswith("a/")},
                    sorted(x for x in (h(i) for i in (1, 2, 3, 4, 11, 12)) if x in hx.engine.device),
                )
            return (hx.engine.run(read), grants_of(hx, "a/"))

        before = a_state()

        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
        @given(st.lists(st.tuples(_ACTIONS, _B_SELECTORS), min_size=1, max_size=6), st.booleans())
        def check(batch: list[tuple[str, pb.Selector]], restock: bool) -> None:
            if restock:  # B keeps sessions that share A's prefix and its own blocks
                hx.engine.store([h(1), h(2)], session="b/y", prefix_hit=True)
                hx.engine.store([h(5), h(6)], session="b/z", continuation="b/c")
            results = apply(hx, B, *[_hint(a, s) for a, s in batch])
            for (action, sel), r in zip(batch, results):
                if sel.WhichOneof("target") != "block_hashes":
                    ident = sel.session.session_id or sel.continuation.continuation_id
                    if not ident.startswith("b/"):
                        assert outcome(r) == ("OUTCOME_REJECTED", "REASON_PERMISSION_DENIED")
            assert a_state() == before

        check()
    finally:
        hx.close()


# ---------------------------------------------------------------- the tenants file


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ("{not json", "line 1"),
        ({"tenants": []}, "tenants:"),
        ({"tenant": []}, "top level"),
        ({"tenants": [{"name": "x", "tokens": ["t"]}]}, "tenants[0].session_prefix"),
        ({"tenants": [{"name": "x", "session_prefix": "x/"}]}, "tenants[0].tokens"),
        ({"tenants": [{"name": "x", "session_prefix": "x/", "tokens": ["has space"]}]}, "tenants[0].tokens[0]"),
        ({"tenants": [{"name": "x", "session_prefix": "x/", "tokens": ["t"], "role": "root"}]}, "tenants[0].role"),
        ({"tenants": [{"name": "x", "session_prefix": "x/", "tokens": ["t"], "pin_budget_blocks": -1}]},
         "tenants[0].pin_budget_blocks"),
        ({"tenants": [{"name": "x", "session_prefix": "x/", "tokens": ["t"], "retention_budget": 5}]},
         "tenants[0].retention_budget"),
        ({"tenants": [{"name": "x", "session_prefix": "x/", "tokens": ["t"]},
                      {"name": "y", "session_prefix": "x/y", "tokens": ["u"]}]}, "tenants[1].session_prefix"),
        ({"tenants": [{"name": "x", "session_prefix": "x/", "tokens": ["t"]},
                      {"name": "y", "session_prefix": "y/", "tokens": ["t"]}]}, "tenants[1].tokens[0]"),
        ({"tenants": [{"name": "x", "session_prefix": "x/", "tokens": ["t"]},
                      {"name": "x", "session_prefix": "y/", "tokens": ["u"]}]}, "tenants[1].name"),
        ({"tenants": [{"name": "x", "session_prefix": "x/", "client_identities": ["cn"]}]}, "KVHINT_TLS_CLIENT_CA_FILE"),
        ({"tenants": [{"name": "x", "session_prefix": "x/", "tokens": ["t"], "rate_limit_hints_per_s": 0}]},
         "tenants[0].rate_limit_hints_per_s"),
        ({"tenants": [{"name": "x", "session_prefix": "x/", "tokens": ["t"], "rate_limit_hints_per_s": "fast"}]},
         "tenants[0].rate_limit_hints_per_s"),
        ({"tenants": [{"name": "x", "session_prefix": "x/", "tokens": ["t"], "rate_limit_hints_per_s": 5,
                       "rate_limit_burst": 0}]}, "tenants[0].rate_limit_burst"),
        ({"tenants": [{"name": "x", "session_prefix": "x/", "tokens": ["t"], "rate_limit_burst": 10}]},
         "tenants[0].rate_limit_burst"),
        # KVHINT_AUTH_TOKEN's administrator is named so (its rate bucket, its labels): not a tenant's name
        ({"tenants": [{"name": "auth-token", "session_prefix": "x/", "tokens": ["t"]}]}, "tenants[0].name"),
    ],
)
def test_a_bad_tenants_file_fails_fast_naming_the_field(tmp_path: Path, doc: object, field: str) -> None:
    path = write(tmp_path, doc)
    started = time.monotonic()
    with pytest.raises(ConfigError) as err:
        ServerConfig.from_env({"KVHINT_TENANTS_FILE": path})
    assert "KVHINT_TENANTS_FILE" in str(err.value) and field in str(err.value), str(err.value)
    assert "has space" not in str(err.value)  # a token is never echoed
    assert time.monotonic() - started < 1


def test_a_missing_tenants_file_fails_naming_the_variable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="KVHINT_TENANTS_FILE=.*cannot read"):
        ServerConfig.from_env({"KVHINT_TENANTS_FILE": str(tmp_path / "absent.json")})


@pytest.mark.parametrize("raw", [b"\xff\xfe{\x00}\x00", "{\"tenants\": [\"caf\u00e9\"]}".encode("latin-1")])
def test_a_tenants_file_that_is_not_utf8_fails_naming_the_variable(tmp_path: Path, raw: bytes) -> None:
    """A UTF-16 or Latin-1 file was a bare UnicodeDecodeError: not a ConfigError, so a served engine's
    scheduler died with a traceback that named neither the variable nor the file."""
    path = tmp_path / "tenants.json"
    path.write_bytes(raw)
    with pytest.raises(ConfigError, match=r"KVHINT_TENANTS_FILE=.*not UTF-8 text: byte 0x(ff|e9) at offset \d+"):
        ServerConfig.from_env({"KVHINT_TENANTS_FILE": str(path)})


def test_a_tenants_file_counts_as_authentication_for_remote_addresses(tmp_path: Path) -> None:
    config = ServerConfig.from_env({"KVHINT_TENANTS_FILE": write(tmp_path, TENANTS), "KVHINT_GRPC_ADDRESS": "0.0.0.0:0"})
    assert config.tenants is not None and [t.name for t in config.tenants.tenants] == ["team-a", "team-b", "ops"]
    assert "tok-a" not in repr(config.tenants.tenants)


def test_the_auth_token_is_an_admin_token_next_to_tenants(tmp_path: Path) -> None:
    hx = Harness(local_engine_info(), tenants_file=write(tmp_path, TENANTS), auth_token="tok-root")
    try:
        hx.engine.store([h(1)], session="a/x")
        hx.engine.store([h(2)], session="b/y")
        assert sessions(hx, (("authorization", "Bearer tok-root"),)) == ["a/x", "b/y"]
    finally:
        hx.close()


# ---------------------------------------------------------------- mTLS client identity


def _openssl(tmp: Path, *args: str) -> None:
    import subprocess

    subprocess.run(["openssl", *args], cwd=tmp, check=True, capture_output=True, timeout=60)


@pytest.mark.skipif(__import__("shutil").which("openssl") is None, reason="needs the openssl CLI to make certificates")
def test_an_mtls_client_certificate_identifies_its_tenant(tmp_path: Path) -> None:
    _openssl(tmp_path, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
             "-days", "1", "-subj", "/CN=kvhint-test-ca")
    for name, subj, ext in (("server", "/CN=localhost", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
                            ("client", "/CN=client-a", "extendedKeyUsage=clientAuth")):
        _openssl(tmp_path, "req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subj)
        (tmp_path / f"{name}.ext").write_text(ext + "\n")
        _openssl(tmp_path, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext")
    doc = {"tenants": [{**TENANTS["tenants"][0], "client_identities": ["client-a"]}, *TENANTS["tenants"][1:]]}
    hx = Harness(local_engine_info(), tenants_file=write(tmp_path, doc), tls_cert_file=str(tmp_path / "server.pem"),
                 tls_key_file=str(tmp_path / "server.key"), tls_client_ca_file=str(tmp_path / "ca.pem"))
    try:
        hx.engine.store([h(1)], session="a/x")
        hx.engine.store([h(2)], session="b/y")
        read = lambda name: (tmp_path / name).read_bytes()  # noqa: E731
        creds = grpc.ssl_channel_credentials(read("ca.pem"), read("client.key"), read("client.pem"))
        with grpc.secure_channel(f"127.0.0.1:{hx.port}", creds) as channel:
            from kvhint.v1 import kvhint_pb2_grpc

            stub = kvhint_pb2_grpc.KvHintServiceStub(channel)
            listed = stub.ListSessions(pb.ListSessionsRequest(), timeout=10)  # no token: the certificate says team-a
            assert [s.session_id for s in listed.sessions] == ["a/x"]
            listed = stub.ListSessions(pb.ListSessionsRequest(), metadata=ADMIN, timeout=10)  # a token wins
            assert [s.session_id for s in listed.sessions] == ["a/x", "b/y"]
    finally:
        hx.close()


def test_a_parent_in_another_tenants_namespace_is_not_shown(hx: Harness) -> None:
    hx.engine.store([h(1)], session="a/parent")
    hx.engine.store([h(1), h(2)], session="b/child", parent_session="a/parent", prefix_hit=True)
    hx.engine.store([h(3)], session="b/kid", parent_session="b/child")
    def parents(who) -> dict[str, str]:
        response = hx.stub.ListSessions(pb.ListSessionsRequest(), metadata=who, timeout=5)
        return {s.session_id: s.parent_session_id for s in response.sessions}
    assert parents(B) == {"b/child": "", "b/kid": "b/child"}
    assert parents(ADMIN)["b/child"] == "a/parent"


def test_a_tenants_own_rate_limit_replaces_the_default(tmp_path: Path) -> None:
    """Team A's own bucket (rate_limit_hints_per_s / rate_limit_burst in the tenants file) holds
    even though the engine-wide default is unlimited; team B and the admin, without one, are not
    limited. With a default set, a tenant's own burst replaces it (team C sends more at once)."""
    doc = json.loads(json.dumps(TENANTS))
    doc["tenants"][0].update(rate_limit_hints_per_s=0.01, rate_limit_burst=2)
    doc["tenants"].append({"name": "team-c", "session_prefix": "c/", "tokens": ["tok-c"],
                           "rate_limit_hints_per_s": 1000, "rate_limit_burst": 6})
    path = write(tmp_path, doc)
    C = (("authorization", "Bearer tok-c"),)
    harness = Harness(local_engine_info(num_device_blocks=64), tenants_file=path)
    try:
        assert len(apply(harness, A, retain("a/s1", 30), retain("a/s2", 30))) == 2
        with pytest.raises(grpc.RpcError) as exc:
            apply(harness, A, retain("a/s3", 30))
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "burst 2" in (exc.value.details() or ""), exc.value.details()
        for _ in range(5):  # no bucket of their own, no default: unlimited
            assert len(apply(harness, B, *(retain(f"b/s{i}", 30) for i in range(4)))) == 4
            assert len(apply(harness, ADMIN, *(retain(f"x/s{i}", 30) for i in range(4)))) == 4
    finally:
        harness.close()
    limited = Harness(local_engine_info(num_device_blocks=64), tenants_file=path, rate_limit_hints_per_s=1000, rate_limit_burst=3)
    try:
        assert len(apply(limited, C, *(retain(f"c/s{i}", 30) for i in range(6)))) == 6  # its own burst of 6
        with pytest.raises(grpc.RpcError) as exc:
            apply(limited, B, *(retain(f"b/s{i}", 30) for i in range(4)))  # the default burst of 3
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "burst of 3" in (exc.value.details() or "")
    finally:
        limited.close()


def test_a_tenant_sees_only_its_own_protection_of_a_shared_block(hx: Harness) -> None:
    """Team A pins a prefix team B shares: B's QueryResidency shows the block, with the class B's
    own grants give it (none: ordinary; after B's Retain: retained, not A's pin), so B cannot tell
    that A pinned it. The admin sees the effective class."""
    hx.engine.store([h(1), h(2)], session="a/x")
    hx.engine.store([h(1), h(2)], session="b/y", prefix_hit=True)
    assert outcome(apply(hx, A, pin("a/x", 60))[0])[0] == "OUTCOME_ACCEPTED"

    def classes(who, session: str) -> set[int]:
        return {b.retention.retention_class for b in device_of(hx, who, session_sel(session))}

    assert classes(A, "a/x") == {pb.RetentionState.CLASS_PINNED}
    assert classes(ADMIN, "b/y") == {pb.RetentionState.CLASS_PINNED}
    assert classes(B, "b/y") == {pb.RetentionState.CLASS_ORDINARY}
    assert outcome(apply(hx, B, retain("b/y", 60, priority=7))[0])[0] == "OUTCOME_ACCEPTED"
    seen = device_of(hx, B, session_sel("b/y"))
    assert {b.retention.retention_class for b in seen} == {pb.RetentionState.CLASS_RETAINED}
    assert {b.retention.priority for b in seen} == {7}


def test_a_tenants_snapshot_shows_only_its_own_protection(hx: Harness) -> None:
    """The same rule in WatchEvents' snapshot: B's snapshot lists the shared blocks as ordinary
    though A pinned them."""
    hx.engine.store([h(1), h(2)], session="a/x")
    hx.engine.store([h(1), h(2)], session="b/y", prefix_hit=True)
    assert outcome(apply(hx, A, pin("a/x", 60))[0])[0] == "OUTCOME_ACCEPTED"

    def snapshot_classes(who) -> dict[bytes, int]:
        out: dict[bytes, int] = {}
        stream = hx.stub.WatchEvents(pb.WatchEventsRequest(start=pb.WatchEventsRequest.START_SNAPSHOT), metadata=who, timeout=10)
        for msg in stream:
            if msg.WhichOneof("payload") == "snapshot_chunk":
                for b in msg.snapshot_chunk.blocks:
                    out[b.block_hash] = b.retention.retention_class
            if msg.WhichOneof("payload") == "snapshot_end":
                stream.cancel()
                break
        return out

    assert snapshot_classes(B) == {h(1): pb.RetentionState.CLASS_ORDINARY, h(2): pb.RetentionState.CLASS_ORDINARY}
    assert set(snapshot_classes(A).values()) == {pb.RetentionState.CLASS_PINNED}


def test_a_tenants_snapshot_counts_only_its_own_sessions_and_blocks(hx: Harness) -> None:
    """SnapshotBegin tells a tenant how many of its sessions and their blocks follow, not how
    many the engine holds; the admin's counts are engine-wide."""
    hx.engine.store([h(1), h(2)], session="a/x")
    hx.engine.store([h(3)], session="a/z")
    hx.engine.store([h(1), h(2), h(4)], session="b/y", prefix_hit=True)

    def begin(who) -> tuple[int, int, set[str]]:
        stream = hx.stub.WatchEvents(pb.WatchEventsRequest(start=pb.WatchEventsRequest.START_SNAPSHOT), metadata=who, timeout=10)
        counts, chunks = (0, 0), set()
        for msg in stream:
            which = msg.WhichOneof("payload")
            if which == "snapshot_begin":
                counts = (msg.snapshot_begin.num_sessions, msg.snapshot_begin.num_blocks)
            elif which == "snapshot_chunk":
                chunks.add(msg.snapshot_chunk.session_id)
            elif which == "snapshot_end":
                stream.cancel()
                break
        return (*counts, chunks)

    assert begin(B) == (1, 3, {"b/y"})
    assert begin(A) == (2, 3, {"a/x", "a/z"})
    assert begin(ADMIN)[:2] == (3, 4)


def test_another_tenants_traffic_does_not_push_a_tenants_ids_out_of_the_window(tmp_path: Path) -> None:
    """Each tenant has an idempotency window of its own (executor.py): team-a's ids cannot push
    team-b's out, so team-b's retry stays a replay; a tenant's own window is still bounded."""
    hx = Harness(local_engine_info(num_device_blocks=64), tenants_file=write(tmp_path, TENANTS), idempotency_window=4)
    try:
        hx.engine.store([h(1), h(2)], session="b/s")
        hx.engine.store([h(3)], session="a/s")
        (first,) = apply(hx, B, retain("b/s", 60, hint_id="b-keep"))
        assert first.outcome == pb.OUTCOME_ACCEPTED and not first.replayed
        for i in range(10):  # more than the window of ids, all team-a's
            apply(hx, A, retain("a/s", 60, hint_id=f"a-{i}"))
        (retry,) = apply(hx, B, retain("b/s", 60, hint_id="b-keep"))
        assert retry.replayed, "team-a's ids pushed team-b's out of the idempotency window"
        (old,) = apply(hx, A, retain("a/s", 60, hint_id="a-0"))
        (new,) = apply(hx, A, retain("a/s", 60, hint_id="a-9"))
        assert not old.replayed and new.replayed
    finally:
        hx.close()
