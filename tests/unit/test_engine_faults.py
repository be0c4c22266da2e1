"""Engine-side faults and outcomes a router relies on, over real gRPC on the fake engine:
an adapter that raises while a hint applies (the hint is REJECTED, the rest of the batch and the
engine go on, and the id stays free for a retry); a tier task that raises (no operation left
PENDING, the history still trimmed); an adapter error during retention expiry (the engine step
survives); unexpected server errors (INTERNAL with ErrorInfo, not UNKNOWN with exception text);
a Pin that a budget left with nothing to pin (CLIPPED to 0 blocks, and no ledger entry)."""

from __future__ import annotations

import time

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvhint_server.adapter import TierRefusal
from kvhint_server.model import Tier
from kvhint_unit_support import FakeClock, error_info, h, pin, retain, session_sel, tiered_engine_info

from kvhint.v1 import kvhint_pb2 as pb


def _raise_on(engine, name: str, when=lambda n: True):
    """Make engine.<name> raise RuntimeError on the calls `when(call number)` picks."""
    original = getattr(engine, name)
    calls = {"n": 0}

    def wrapped(*args, **kwargs):
        calls["n"] += 1
        if when(calls["n"]):
            raise RuntimeError(f"adapter bug in {name}")
        return original(*args, **kwargs)

    setattr(engine, name, wrapped)
    return lambda: setattr(engine, name, original)


def test_a_hint_the_adapter_fails_is_rejected_and_the_rest_of_the_batch_applies(harness):
    harness.engine.store([h(1), h(2)], session="a")
    harness.engine.store([h(3)], session="b")
    harness.engine.store([h(4)], session="c")
    restore = _raise_on(harness.engine, "refile", when=lambda n: n == 2)  # the second hint's
    results = harness.apply(retain("a", 30, hint_id="h-a"), retain("b", 30, hint_id="h-b"), retain("c", 30)).results
    assert [r.outcome for r in results] == [pb.OUTCOME_ACCEPTED, pb.OUTCOME_REJECTED, pb.OUTCOME_ACCEPTED]
    failed = results[1]
    assert failed.reason == pb.REASON_OPERATION_FAILED and "RuntimeError" in failed.message
    restore()
    # The failed id was not remembered: re-sending it applies it (not a replay of the failure).
    again = harness.apply(retain("b", 30, hint_id="h-b")).results[0]
    assert again.outcome == pb.OUTCOME_ACCEPTED and not again.replayed
    assert harness.engine.thread.is_alive()


def test_a_tier_task_that_raises_leaves_no_pending_operation_and_the_history_is_trimmed(make_harness):
    harness = make_harness(info=tiered_engine_info(), operation_history=3)
    engine = harness.engine
    engine.store([h(1)], session="a")
    demote = pb.Hint(selector=session_sel("a"), demote=pb.DemoteAction())
    restore = _raise_on(engine, "start_tier_task")
    (failed,) = harness.apply(demote).results
    assert failed.outcome == pb.OUTCOME_REJECTED and failed.reason == pb.REASON_OPERATION_FAILED
    restore()
    assert harness.engine.run(lambda: len(harness.core.operations._ops)) == 0
    # One operation that never finishes must not keep every later one in memory.
    (stuck,) = harness.apply(demote).results
    assert stuck.outcome == pb.OUTCOME_DEFERRED
    for i in range(20):
        (r,) = harness.apply(demote).results
        harness.core.operations.complete(r.operation_id, ok=True, blocks={Tier.HOST: 1})
    held = harness.engine.run(lambda: list(harness.core.operations._ops))
    assert len(held) <= 4 and stuck.operation_id in held
    op = harness.stub.GetOperation(pb.GetOperationRequest(operation_id=stuck.operation_id), timeout=5).operation
    assert op.state in (pb.Operation.STATE_PENDING, pb.Operation.STATE_RUNNING)


def test_an_adapter_error_during_retention_expiry_does_not_end_the_engine_step():
    from kvhint_unit_support import Harness

    clock = FakeClock()
    harness = Harness(monotonic=clock)
    try:
        harness.engine.store([h(1)], session="a")
        assert harness.apply(retain("a", 5)).results[0].outcome == pb.OUTCOME_ACCEPTED
        _raise_on(harness.engine, "refile")
        clock.advance(10)  # the grant expires at the next step boundary; its re-filing raises
        harness.engine.request_wakeup()
        time.sleep(0.05)
        assert harness.engine.thread.is_alive()
        sessions = harness.stub.ListSessions(pb.ListSessionsRequest(), timeout=5).sessions
        assert [s.session_id for s in sessions] == ["a"]
    finally:
        harness.close()


def test_an_unexpected_server_error_is_internal_with_error_info(harness):
    _raise_on(harness.engine, "lookup")  # QueryResidency of blocks the index does not know asks the adapter
    by_hash = pb.Selector(block_hashes=pb.BlockHashSelector(block_hashes=[h(7)]))
    with pytest.raises(grpc.RpcError) as err:
        harness.stub.QueryResidency(pb.QueryResidencyRequest(selector=by_hash), timeout=5)
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "adapter bug" not in err.value.details()  # no internal exception text on the wire
    info = error_info(err.value)
    assert info is not None and info.reason == "REASON_OPERATION_FAILED"


def test_a_pin_the_budget_leaves_nothing_to_pin_changes_nothing_and_leaves_no_owner_entry(make_harness):
    harness = make_harness(pin_budget_fraction=0.2)  # 2 of 10 usable blocks
    harness.engine.store([h(1), h(2)], session="a")
    harness.engine.store([h(3), h(4)], session="b")
    assert harness.apply(pin("a", 60)).results[0].outcome == pb.OUTCOME_ACCEPTED
    (r,) = harness.apply(pin("b", 60)).results
    assert r.outcome == pb.OUTCOME_CLIPPED and r.reason == pb.REASON_PIN_BUDGET
    assert [(c.reason, c.requested_blocks, c.granted_blocks) for c in r.clips] == [(pb.REASON_PIN_BUDGET, 2, 0)]
    assert not r.affected_blocks
    owners = harness.engine.run(lambda: set(harness.core.ledger._by_owner))
    assert owners == {"s:a"}  # one empty entry per such Pin before: memory that grew with every call
    assert {b.retention.retention_class for b in harness.stub.QueryResidency(
        pb.QueryResidencyRequest(selector=session_sel("b")), timeout=5).blocks} == {pb.RetentionState.CLASS_ORDINARY}


def test_a_rejected_hint_reaches_the_watchers_of_the_session_it_names(harness):
    before = harness.bus.last_sequence
    bad = pb.Hint(selector=session_sel("s"), retain=pb.RetainAction())  # no ttl: INVALID_HINT
    (r,) = harness.apply(bad).results
    assert r.outcome == pb.OUTCOME_REJECTED
    (event,) = [e for e in harness.bus.read_after(before, 100) if type(e.payload).__name__ == "HintApplied"]
    assert "s" in event.sessions


def test_query_residency_reports_only_the_tiers_asked_for(make_harness):
    harness = make_harness(info=tiered_engine_info())
    harness.engine.store([h(1)], session="a")
    harness.engine.store([h(1)], tier=Tier.HOST)
    resp = harness.stub.QueryResidency(
        pb.QueryResidencyRequest(selector=session_sel("a"), tiers=[pb.TIER_HOST]), timeout=5
    )
    assert [list(b.tiers) for b in resp.blocks] == [[pb.TIER_HOST]]
    assert {c.tier: c.blocks for c in resp.totals} == {pb.TIER_HOST: 1}


def test_operations_in_flight_do_not_shorten_the_history_of_finished_ones(make_harness):
    """KVHINT_OPERATION_HISTORY counts finished operations: with as many still in flight, the
    last one to finish stays readable (GetOperation), however many more are started."""
    harness = make_harness(info=tiered_engine_info(), operation_history=2)
    harness.engine.store([h(1)], session="a")
    demote = pb.Hint(selector=session_sel("a"), demote=pb.DemoteAction())
    in_flight = [harness.apply(demote).results[0].operation_id for _ in range(2)]
    (done,) = harness.apply(demote).results
    harness.core.operations.complete(done.operation_id, ok=True, blocks={Tier.HOST: 1})
    harness.apply(demote)  # one more started while the first two are still running
    op = harness.stub.GetOperation(pb.GetOperationRequest(operation_id=done.operation_id), timeout=5).operation
    assert op.state == pb.Operation.STATE_SUCCEEDED
    for op_id in in_flight:
        assert harness.stub.GetOperation(pb.GetOperationRequest(operation_id=op_id), timeout=5).operation.state in (
            pb.Operation.STATE_PENDING, pb.Operation.STATE_RUNNING)


@settings(max_examples=200, deadline=None)
@given(history=st.integers(0, 4), steps=st.lists(st.tuples(st.sampled_from(["create", "finish", "discard"]), st.integers(0, 7)),
                                                  max_size=40))
def test_the_operation_history_keeps_every_unfinished_and_the_last_finished_operations(history, steps):
    """Whatever mix of operations is in flight: every unfinished one is found, the last
    `history` to finish are found with their outcome, and nothing more is kept."""
    from kvhint_server.events import EventBus
    from kvhint_server.model import Action
    from kvhint_server.operations import OperationRegistry, OperationState

    ops = OperationRegistry(EventBus(1024), history)
    unfinished: list[str] = []
    finished: list[str] = []  # in the order they finished
    for kind, pick in steps:
        if kind == "create":
            unfinished.append(ops.create("hint", Action.DEMOTE, ("s",)).operation_id)
        elif unfinished:
            op_id = unfinished.pop(pick % len(unfinished))
            if kind == "finish":
                assert ops.complete(op_id, ok=pick % 2 == 0) is not None
                finished.append(op_id)
            else:
                ops.discard(op_id)
        kept = finished[max(0, len(finished) - history):] if history else []
        for op_id in unfinished:
            assert ops.get(op_id) is not None and not ops.get(op_id).state.done
        for op_id in kept:
            op = ops.get(op_id)
            assert op is not None, f"{op_id} finished among the last {history} and was forgotten"
            assert op.state in (OperationState.SUCCEEDED, OperationState.FAILED)
        assert len(ops._ops) == len(unfinished) + len(kept)
