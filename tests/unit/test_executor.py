"""HintExecutor through ApplyHints over real gRPC, on the fake engine.

The fake engine (kvhint_unit_support.FakeEngine) reports residency through the
core's hooks on its engine thread; the results and the state they leave
behind are read back over the wire (ApplyHints, QueryResidency, ListSessions)
and from the event bus.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from google.protobuf import duration_pb2
from kvhint_server.adapter import TierRefusal
from kvhint_server.model import Reason, Tier
from kvhint_unit_support import FakeClock, Harness, error_info, h, pin, retain, session_sel, tiered_engine_info

from kvhint.v1 import kvhint_pb2 as pb
from kvhint_server.events import HintApplied

R = pb.RetentionState


def residency(harness, session: str) -> dict[bytes, pb.BlockInfo]:
    resp = harness.stub.QueryResidency(pb.QueryResidencyRequest(selector=session_sel(session)), timeout=5)
    return {b.block_hash: b for b in resp.blocks}


def sessions(harness) -> list[str]:
    return [s.session_id for s in harness.stub.ListSessions(pb.ListSessionsRequest(), timeout=5).sessions]


def hint_events(harness, after: int) -> list[HintApplied]:
    events = harness.bus.read_after(after, 10_000)
    assert events is not None
    return [e.payload for e in events if isinstance(e.payload, HintApplied)]


def test_exactly_one_result_per_hint_in_request_order(harness):
    harness.engine.store([h(1), h(2), h(3)], session="a")
    before = harness.bus.last_sequence
    batch = [
        retain("a", 30, priority=2, hint_id="r"),
        pin("nobody", 30, hint_id="m"),
        pb.Hint(hint_id="bad", release=pb.ReleaseAction()),  # no selector
        pb.Hint(hint_id="", selector=pb.Selector(block_hashes=pb.BlockHashSelector(block_hashes=[h(3)])),
                evict=pb.EvictAction()),
        pb.Hint(hint_id="d", selector=session_sel("a"), demote=pb.DemoteAction()),
        retain("a", 30, hint_id="r2"),
    ]
    resp = harness.apply(*batch)
    assert [r.hint_id for r in resp.results] == ["r", "m", "bad", "", "d", "r2"]
    assert [r.outcome for r in resp.results] == [
        pb.OUTCOME_ACCEPTED, pb.OUTCOME_MISSING, pb.OUTCOME_REJECTED, pb.OUTCOME_ACCEPTED, pb.OUTCOME_REJECTED,
        pb.OUTCOME_ACCEPTED,
    ]
    assert [r.reason for r in resp.results] == [
        pb.REASON_UNSPECIFIED, pb.REASON_NOT_RESIDENT, pb.REASON_INVALID_HINT, pb.REASON_UNSPECIFIED,
        pb.REASON_UNSUPPORTED, pb.REASON_UNSPECIFIED,
    ]
    # The evict ran after the first retain and before the second: r2 covers 2 blocks.
    assert [(c.tier, c.blocks) for c in resp.results[0].affected_blocks] == [(pb.TIER_DEVICE, 3)]
    assert [(c.tier, c.blocks) for c in resp.results[5].affected_blocks] == [(pb.TIER_DEVICE, 2)]
    # Every hint is observable, in order, at or before applied_at_sequence.
    events = harness.bus.read_after(before, 1000)
    assert events is not None and max(e.sequence for e in events) == resp.applied_at_sequence
    applied = [e.payload for e in events if isinstance(e.payload, HintApplied)]
    assert [a.result.hint_id for a in applied] == [r.hint_id for r in resp.results]
    assert [int(a.result.outcome) for a in applied] == [r.outcome for r in resp.results]
    assert resp.epoch == harness.bus.epoch


def test_idempotent_hint_ids(harness):
    harness.engine.store([h(1), h(2)], session="a")
    first = harness.apply(retain("a", 30, priority=7, hint_id="same"))
    assert first.results[0].outcome == pb.OUTCOME_ACCEPTED and not first.results[0].replayed
    seq = harness.bus.last_sequence
    again = harness.apply(retain("a", 30, priority=7, hint_id="same"))
    r = again.results[0]
    assert r.replayed is True
    assert (r.outcome, list(r.affected_blocks), r.effective_ttl) == (
        first.results[0].outcome, list(first.results[0].affected_blocks), first.results[0].effective_ttl)
    assert harness.bus.last_sequence == seq, "a replayed hint must not publish a second HintApplied"
    assert again.applied_at_sequence == seq
    # Same id, different hint: rejected, and the first grant is untouched.
    conflict = harness.apply(retain("a", 30, priority=1, hint_id="same")).results[0]
    assert (conflict.outcome, conflict.reason) == (pb.OUTCOME_REJECTED, pb.REASON_HINT_ID_CONFLICT)
    assert not conflict.replayed
    assert {b.retention.priority for b in residency(harness, "a").values()} == {7}
    # Hints without an id are never deduplicated.
    before = harness.bus.last_sequence
    a1 = harness.apply(retain("a", 30, priority=3)).results[0]
    a2 = harness.apply(retain("a", 30, priority=3)).results[0]
    assert not a1.replayed and not a2.replayed
    assert len(hint_events(harness, before)) == 2


def test_ttl_above_the_cap_is_clipped_to_the_cap(make_harness):
    harness = make_harness(max_ttl_s=60.0)
    harness.engine.store([h(1)], session="a")
    t0 = time.time()
    r = harness.apply(retain("a", 3600.5, priority=1, hint_id="t")).results[0]
    assert (r.outcome, r.reason) == (pb.OUTCOME_CLIPPED, pb.REASON_TTL_CAPPED)
    [clip] = r.clips
    assert clip.reason == pb.REASON_TTL_CAPPED
    assert clip.requested_ttl.ToTimedelta().total_seconds() == pytest.approx(3600.5)
    assert clip.granted_ttl.ToTimedelta().total_seconds() == 60.0
    assert r.effective_ttl.ToTimedelta().total_seconds() == 60.0
    block = residency(harness, "a")[h(1)]
    assert block.retention.retention_class == R.CLASS_RETAINED
    assert block.retention.expires_at.ToMicroseconds() / 1e6 == pytest.approx(t0 + 60, abs=2)
    # Within the cap: accepted as asked.
    r = harness.apply(pin("a", 59)).results[0]
    assert r.outcome == pb.OUTCOME_ACCEPTED and r.effective_ttl.ToTimedelta().total_seconds() == 59


def test_pin_budget_clips_to_the_budget(harness):
    # 11 device blocks, pin_budget_fraction 0.5 -> 5 blocks (GetCapabilities says so).
    budget = harness.stub.GetCapabilities(pb.GetCapabilitiesRequest()).limits.pin_budget_blocks
    assert budget == 5
    chain = [h(i) for i in range(1, 9)]
    harness.engine.store(chain, session="a")
    r = harness.apply(pin("a", 30, hint_id="p")).results[0]
    assert (r.outcome, r.reason) == (pb.OUTCOME_CLIPPED, pb.REASON_PIN_BUDGET)
    [clip] = r.clips
    assert (clip.requested_blocks, clip.granted_blocks) == (8, budget)
    assert [(c.tier, c.blocks) for c in r.affected_blocks] == [(pb.TIER_DEVICE, budget)]
    blocks = residency(harness, "a")
    classes = [blocks[x].retention.retention_class for x in chain]
    assert classes == [R.CLASS_PINNED] * 5 + [R.CLASS_ORDINARY] * 3  # from the start of the chain
    # Another session pinning blocks that are already pinned costs no budget.
    harness.engine.store(chain[:3], session="b", prefix_hit=True)
    harness.engine.store([h(20)], session="b", first_position=3, parent=chain[2])
    r = harness.apply(pin("b", 30)).results[0]
    assert (r.outcome, r.reason) == (pb.OUTCOME_CLIPPED, pb.REASON_PIN_BUDGET)
    assert (r.clips[0].requested_blocks, r.clips[0].granted_blocks) == (4, 3)
    assert residency(harness, "b")[h(20)].retention.retention_class == R.CLASS_ORDINARY
    # Releasing a's pins frees budget only for blocks nobody else pins.
    harness.apply(pb.Hint(selector=session_sel("a"), release=pb.ReleaseAction()))
    r = harness.apply(pin("b", 30)).results[0]
    assert r.outcome == pb.OUTCOME_ACCEPTED
    assert residency(harness, "b")[h(20)].retention.retention_class == R.CLASS_PINNED


@pytest.mark.parametrize("action", ["retain", "pin", "evict", "release"])
def test_unknown_session_is_missing(harness, action):
    harness.engine.store([h(1)], session="a")
    hint = pb.Hint(hint_id="x", selector=session_sel("ghost"))
    if action == "retain":
        hint.retain.ttl.FromSeconds(10)
    elif action == "pin":
        hint.pin.ttl.FromSeconds(10)
    else:
        getattr(hint, action).SetInParent()
    r = harness.apply(hint).results[0]
    assert (r.outcome, r.reason) == (pb.OUTCOME_MISSING, pb.REASON_NOT_RESIDENT)
    assert not r.affected_blocks
    assert residency(harness, "a")[h(1)].retention.retention_class == R.CLASS_ORDINARY


def test_release_counts_each_block_it_applied_to_once(harness):
    """Release applies to the blocks whose grants it dropped and the blocks it made first eviction
    candidates: five distinct blocks here (2 retained and shared, 3 the session's alone), not the
    larger of the two counts (3)."""
    engine = harness.engine
    engine.store([h(1), h(2), h(3), h(4), h(5)], session="s")
    engine.store([h(1), h(2)], session="t", prefix_hit=True)
    harness.apply(pb.Hint(selector=session_sel("s", end=2), retain=pb.RetainAction(priority=5, ttl=duration_pb2.Duration(seconds=60))))
    r = harness.apply(pb.Hint(selector=session_sel("s"), release=pb.ReleaseAction())).results[0]
    assert r.outcome == pb.OUTCOME_ACCEPTED
    assert [(c.tier, c.blocks) for c in r.affected_blocks] == [(pb.TIER_DEVICE, 5)]
    assert engine.demoted_first == [h(3), h(4), h(5)]


def test_release_drops_only_that_sessions_retention(harness):
    engine = harness.engine
    engine.store([h(1), h(2), h(3)], session="a")
    engine.store([h(1), h(2)], session="b", prefix_hit=True)
    engine.store([h(4)], session="b", first_position=2, parent=h(2))
    assert harness.apply(retain("a", 60, priority=5)).results[0].outcome == pb.OUTCOME_ACCEPTED
    assert harness.apply(retain("b", 60, priority=1)).results[0].outcome == pb.OUTCOME_ACCEPTED
    assert residency(harness, "b")[h(1)].retention.priority == 5  # highest priority over all sessions
    r = harness.apply(pb.Hint(hint_id="rel", selector=session_sel("a"), release=pb.ReleaseAction())).results[0]
    assert r.outcome == pb.OUTCOME_ACCEPTED
    # Applied to its three blocks: grants dropped on 1, 2 and 3, and 3 made a first candidate.
    assert [(c.tier, c.blocks) for c in r.affected_blocks] == [(pb.TIER_DEVICE, 3)]
    blocks = residency(harness, "b")
    for x in (h(1), h(2), h(4)):
        assert (blocks[x].retention.retention_class, blocks[x].retention.priority) == (R.CLASS_RETAINED, 1)
    # a's own block lost its protection and became a first eviction candidate.
    q = harness.stub.QueryResidency(pb.QueryResidencyRequest(
        selector=pb.Selector(block_hashes=pb.BlockHashSelector(block_hashes=[h(3)]))))
    assert q.blocks[0].retention.retention_class == R.CLASS_ORDINARY
    assert list(q.blocks[0].tiers) == [pb.TIER_DEVICE]  # still cached, still reusable
    assert engine.demoted_first == [h(3)]
    assert sessions(harness) == ["b"]
    # Releasing again: nothing selected and no retention held.
    r = harness.apply(pb.Hint(selector=session_sel("a"), release=pb.ReleaseAction())).results[0]
    assert r.outcome == pb.OUTCOME_MISSING


def test_evict_skips_blocks_in_use_and_pinned_by_other_sessions(harness):
    engine = harness.engine
    engine.store([h(1), h(2), h(3), h(4)], session="a")
    engine.store([h(1)], session="b", prefix_hit=True)
    assert harness.apply(pin("b", 60)).results[0].outcome == pb.OUTCOME_ACCEPTED
    engine.set_in_use([h(2)])
    before = harness.bus.last_sequence
    r = harness.apply(pb.Hint(selector=session_sel("a"), evict=pb.EvictAction())).results[0]
    assert r.outcome == pb.OUTCOME_CLIPPED
    assert {c.reason for c in r.clips} == {pb.REASON_PINNED_BY_OTHER_SESSION, pb.REASON_BLOCKS_IN_USE}
    assert [(c.tier, c.blocks) for c in r.affected_blocks] == [(pb.TIER_DEVICE, 2)]
    assert set(engine.device) == {h(1), h(2)}
    removed = [e.payload for e in harness.bus.read_after(before, 100) if e.kind.name == "BLOCKS_REMOVED"]
    assert [x for p in removed for x in p.block_hashes] == [h(4), h(3)]  # tail first
    assert all(p.cause.name == "EVICT_HINT" for p in removed)


def test_max_blocks_takes_retain_from_the_start_and_evict_from_the_end(harness):
    chain = [h(i) for i in range(1, 6)]
    harness.engine.store(chain, session="a")
    r = harness.apply(retain("a", 60, priority=1, max_blocks=2)).results[0]
    assert (r.outcome, r.reason) == (pb.OUTCOME_CLIPPED, pb.REASON_MAX_BLOCKS)
    assert (r.clips[0].requested_blocks, r.clips[0].granted_blocks) == (5, 2)
    blocks = residency(harness, "a")
    assert [blocks[x].retention.retention_class for x in chain] == [R.CLASS_RETAINED] * 2 + [R.CLASS_ORDINARY] * 3
    r = harness.apply(pb.Hint(selector=session_sel("a"), evict=pb.EvictAction(), max_blocks=2)).results[0]
    assert r.reason == pb.REASON_MAX_BLOCKS
    assert set(harness.engine.device) == set(chain[:3])


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(order=st.permutations(range(5)), keep=st.integers(1, 4), action=st.sampled_from(["pin", "evict"]))
def test_a_block_hash_selector_is_taken_in_chain_order_whatever_order_the_hashes_came_in(make_harness, order, keep, action):
    """max_blocks takes Pin's blocks from the start of the chain and Evict's from its end, for
    explicit hashes as for a session (proto, Hint.max_blocks), and QueryResidency reports them
    in chain order: the order the hashes were sent in does not matter."""
    harness = make_harness()
    chain = [h(i) for i in range(1, 6)]
    harness.engine.store(chain, session="a")
    selector = pb.Selector(block_hashes=pb.BlockHashSelector(block_hashes=[chain[i] for i in order]))
    reported = harness.stub.QueryResidency(pb.QueryResidencyRequest(selector=selector), timeout=5).blocks
    assert [b.block_hash for b in reported] == chain
    if action == "pin":
        hint = pb.Hint(selector=selector, max_blocks=keep, pin=pb.PinAction(ttl=duration_pb2.Duration(seconds=60)))
        assert harness.apply(hint).results[0].reason == pb.REASON_MAX_BLOCKS
        blocks = residency(harness, "a")
        assert [blocks[x].retention.retention_class == R.CLASS_PINNED for x in chain] == [True] * keep + [False] * (5 - keep)
    else:
        assert harness.apply(pb.Hint(selector=selector, max_blocks=keep, evict=pb.EvictAction())).results[0].reason == pb.REASON_MAX_BLOCKS
        assert set(harness.engine.device) == set(chain[: 5 - keep]), "the tail went, the prefix stays"


def test_expired_retention_reads_as_ordinary(harness):
    harness.engine.store([h(1)], session="a")
    harness.apply(pin("a", 0.2))
    assert residency(harness, "a")[h(1)].retention.retention_class == R.CLASS_PINNED
    time.sleep(0.3)
    assert residency(harness, "a")[h(1)].retention.retention_class == R.CLASS_ORDINARY
    assert h(1) in harness.engine.refiled  # the engine was asked to re-file it


@pytest.mark.parametrize("action", ["demote", "prefetch", "share"])
def test_unadvertised_tier_actions_are_rejected_unsupported(harness, action):
    harness.engine.store([h(1)], session="a")
    hint = pb.Hint(hint_id=action, selector=session_sel("a"))
    getattr(hint, action).SetInParent()
    if action == "share":
        hint.share.destination = "peer:1"
    r = harness.apply(hint).results[0]
    assert (r.outcome, r.reason) == (pb.OUTCOME_REJECTED, pb.REASON_UNSUPPORTED)
    assert harness.engine.tier_tasks == []


def share(session: str, destination: str = "peer-b") -> pb.Hint:
    return pb.Hint(selector=session_sel(session), share=pb.ShareAction(destination=destination))


def test_tier_actions_are_deferred_with_an_operation(make_harness):
    harness = make_harness(info=tiered_engine_info())
    harness.engine.store([h(1), h(2)], session="a")
    r = harness.apply(share("a")).results[0]
    assert r.outcome == pb.OUTCOME_DEFERRED and r.operation_id
    (task,) = harness.engine.tier_tasks
    assert task.operation_id == r.operation_id and task.block_hashes == (h(1), h(2))
    op = harness.stub.GetOperation(pb.GetOperationRequest(operation_id=r.operation_id)).operation
    assert op.state == pb.Operation.STATE_PENDING and op.destination == "peer-b"


def test_share_and_prefetch_start_from_lower_tier_copies(make_harness):
    harness = make_harness(info=tiered_engine_info())
    harness.engine.store([h(1), h(2)], session="a")
    harness.engine.store([h(1), h(2)], tier=Tier.HOST)
    harness.engine.remove([h(1), h(2)])  # only the host copies are left
    assert harness.apply(share("a")).results[0].outcome == pb.OUTCOME_DEFERRED
    prefetch = pb.Hint(selector=session_sel("a"), prefetch=pb.PrefetchAction())
    assert harness.apply(prefetch).results[0].outcome == pb.OUTCOME_DEFERRED
    demote = pb.Hint(selector=session_sel("a"), demote=pb.DemoteAction())
    assert harness.apply(demote).results[0].outcome == pb.OUTCOME_MISSING  # nothing left on the device


def test_a_refused_tier_action_is_rejected_with_the_engines_reason_and_leaves_no_operation(make_harness):
    harness = make_harness(info=tiered_engine_info())
    harness.engine.store([h(1)], session="a")
    harness.engine.refuse_tier_tasks = TierRefusal(Reason.RESOURCE_EXHAUSTED, "host tier full")
    before = harness.bus.last_sequence
    r = harness.apply(share("a")).results[0]
    assert (r.outcome, r.reason, r.message) == (pb.OUTCOME_REJECTED, pb.REASON_RESOURCE_EXHAUSTED, "host tier full")
    assert not r.operation_id
    published = harness.bus.read_after(before, 100)
    assert [type(e.payload).__name__ for e in published] == ["HintApplied"]  # no OperationCompleted


def test_empty_and_oversized_batches_fail_with_error_info(make_harness):
    harness = make_harness(max_hints_per_batch=4)
    with pytest.raises(grpc.RpcError) as exc:
        harness.stub.ApplyHints(pb.ApplyHintsRequest(), timeout=5)
    assert exc.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    info = error_info(exc.value)
    assert info is not None
    assert (info.domain, info.reason, info.metadata["field"]) == ("kvhint.v1", "REASON_MALFORMED_REQUEST", "hints")

    before = harness.bus.last_sequence
    with pytest.raises(grpc.RpcError) as exc:
        harness.apply(*[retain("a", 1)] * 5)
    assert exc.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    info = error_info(exc.value)
    assert info is not None
    assert (info.domain, info.reason, info.metadata["field"]) == ("kvhint.v1", "REASON_TOO_MANY_HINTS", "hints")
    assert harness.bus.last_sequence == before, "a failed batch must apply nothing"
    assert len(harness.apply(*[retain("a", 1)] * 4).results) == 4


HUGE_TTL = duration_pb2.Duration(seconds=2**63 - 1)  # a valid int64, far outside Duration's +-10000 years


def test_out_of_range_ttl_never_fails_the_rpc(harness):
    harness.engine.store([h(1)], session="a")
    r = harness.apply(pb.Hint(hint_id="huge", selector=session_sel("a"), retain=pb.RetainAction(ttl=HUGE_TTL))).results[0]
    assert (r.outcome, r.reason) in {
        (pb.OUTCOME_CLIPPED, pb.REASON_TTL_CAPPED), (pb.OUTCOME_REJECTED, pb.REASON_INVALID_HINT)}


def test_out_of_range_ttl_never_breaks_watch_streams(harness):
    harness.engine.store([h(1)], session="a")
    watcher = harness.stub.WatchEvents(pb.WatchEventsRequest(heartbeat_interval=duration_pb2.Duration(seconds=60)),
                                       timeout=10)
    harness.wait_subscribers(1)
    try:
        harness.apply(pb.Hint(hint_id="huge", selector=session_sel("a"), pin=pb.PinAction(ttl=HUGE_TTL)))
    except grpc.RpcError:
        pass  # see test_out_of_range_ttl_never_fails_the_rpc
    harness.engine.store([h(2)], session="a")
    try:
        kinds = [next(watcher).WhichOneof("payload") for _ in range(2)]
    finally:
        watcher.cancel()
    assert kinds == ["hint_applied", "blocks_stored"]


def test_evicted_pinned_blocks_give_their_budget_back(harness):
    chain = [h(i) for i in range(1, 6)]
    harness.engine.store(chain, session="a")
    assert harness.apply(pin("a", 60)).results[0].outcome == pb.OUTCOME_ACCEPTED  # 5 of 5
    harness.engine.store([h(10)], session="b")
    assert harness.apply(pin("b", 60)).results[0].reason == pb.REASON_PIN_BUDGET  # budget exhausted
    harness.engine.remove(chain[3:])  # the engine evicts two of a's pinned blocks
    r = harness.apply(pin("b", 60)).results[0]
    assert r.outcome == pb.OUTCOME_ACCEPTED
    assert residency(harness, "b")[h(10)].retention.retention_class == R.CLASS_PINNED


# ---- residency reported by anonymous requests (no session coordinates)


def _parent_only_then_anonymous_restore(harness) -> None:
    """s owns a -> b -> c; b is evicted (parent-only, it connects c), then an
    anonymous request with the same prefix recomputes b on the device."""
    engine = harness.engine
    engine.store([h(1), h(2), h(3)], session="s")
    engine.remove([h(2)])
    engine.store([h(2)], first_position=1, parent=h(1))  # no session: RequestCoords() as the vLLM adapter passes


def test_anonymous_restore_and_eviction_does_not_expire_the_session(harness):
    _parent_only_then_anonymous_restore(harness)
    harness.engine.remove([h(2)])  # evicted again
    harness.engine.remove([h(1)])
    assert h(3) in harness.engine.device
    assert sessions(harness) == ["s"]
    blocks = residency(harness, "s")
    assert list(blocks[h(3)].tiers) == [pb.TIER_DEVICE]


def test_pin_covers_a_block_restored_by_an_anonymous_request_once_the_session_hits_it(harness):
    # Membership ends with a block's last copy (kvhint.proto MembershipChanged):
    # the anonymous re-store does not give b back to s, so a pin covers a and c ...
    _parent_only_then_anonymous_restore(harness)
    r = harness.apply(pin("s", 60)).results[0]
    assert [(c.tier, c.blocks) for c in r.affected_blocks] == [(pb.TIER_DEVICE, 2)]
    assert h(2) not in residency(harness, "s")
    # ... until a request of s hits b again.
    harness.engine.store([h(1), h(2)], session="s", prefix_hit=True)
    r = harness.apply(pin("s", 60)).results[0]
    assert [(c.tier, c.blocks) for c in r.affected_blocks] == [(pb.TIER_DEVICE, 3)]
    assert residency(harness, "s")[h(2)].retention.retention_class == R.CLASS_PINNED


def test_expired_retention_is_refiled_at_the_next_step_boundary(make_harness):
    clock = FakeClock()
    harness = make_harness(monotonic=clock)
    harness.engine.store([h(1), h(2)], session="a")
    harness.apply(pin("a", 1))
    harness.apply(retain("a", 3, priority=4))  # replaces the pin (same session)
    harness.engine.refiled.clear()
    harness.engine.run(lambda: clock.advance(2))
    time.sleep(0.05)
    assert harness.engine.refiled == [], "nothing expired yet"
    harness.engine.run(lambda: clock.advance(2))
    time.sleep(0.05)
    assert sorted(harness.engine.refiled) == [h(1), h(2)]
    assert {b.retention.retention_class for b in residency(harness, "a").values()} == {R.CLASS_ORDINARY}


def test_expired_pins_are_refiled_even_when_a_pin_hint_expires_them(make_harness):
    clock = FakeClock()
    harness = make_harness(monotonic=clock)
    engine = harness.engine
    engine.store([h(1)], session="a")
    engine.store([h(2)], session="b")
    assert harness.apply(pin("a", 1)).results[0].outcome == pb.OUTCOME_ACCEPTED
    engine.refiled.clear()

    def time_passes() -> None:
        clock.advance(5)  # a's pin ends ...
        time.sleep(0.3)  # ... and b's Pin hint is queued behind this task, before the next expiry pass

    done = harness.core.submit(time_passes)
    time.sleep(0.05)
    assert harness.apply(pin("b", 60)).results[0].outcome == pb.OUTCOME_ACCEPTED
    done.result(timeout=5)
    time.sleep(0.1)  # several step boundaries
    assert residency(harness, "a")[h(1)].retention.retention_class == R.CLASS_ORDINARY
    assert h(1) in engine.refiled, "the engine was never asked to re-file the block whose pin ended"


def test_sessions_that_read_a_shared_prefix_are_bounded_by_max_index_sessions(make_harness):
    """Every session that reads a hot shared prefix becomes a member of its blocks, which are
    rarely evicted: the block count stays at the prefix's, so only a bound on sessions keeps
    the index (and ListSessions, and every follower's mirror) from growing with each session
    ever served. Past it the least recently active sessions go, with MembershipChanged."""
    harness = make_harness(max_index_sessions=10)
    prefix = [h(900 + k) for k in range(3)]
    harness.engine.store(prefix, session="s0")
    start = harness.bus.last_sequence
    for i in range(1, 40):
        harness.engine.store(prefix, session=f"s{i}", prefix_hit=True)
    listed = sessions(harness)
    assert 1 <= len(listed) <= 10 and "s39" in listed and "s0" not in listed
    assert len(harness.engine.run(lambda: harness.core.index.members(prefix[-1], limit=1000))) <= 10
    left = [e.payload for e in harness.bus.read_after(start, 10_000) if type(e.payload).__name__ == "MembershipChanged"]
    assert {p.session_id for p in left} >= {"s0", "s1"}
    assert harness.engine.run(lambda: len(harness.core.index.nodes)) == 3  # the blocks stay cached


def test_continuations_are_bounded_by_max_index_continuations(make_harness):
    harness = make_harness(max_index_continuations=10)
    prefix = [h(800 + k) for k in range(2)]
    for i in range(40):
        harness.engine.store(prefix, continuation=f"c{i}", prefix_hit=i > 0)
    known = harness.engine.run(lambda: list(harness.core.index.continuations))
    assert 1 <= len(known) <= 10 and "c39" in known and "c0" not in known
    cont = pb.Selector(continuation=pb.ContinuationSelector(continuation_id="c39"))
    resp = harness.stub.QueryResidency(pb.QueryResidencyRequest(selector=cont), timeout=5)
    assert [b.block_hash for b in resp.blocks] == prefix


def test_a_long_lived_session_lists_only_the_continuations_the_index_still_tracks(make_harness):
    """An agent session that runs for days records a continuation per tool call. Past
    max_index_continuations the index forgets the oldest, and the session stops listing them:
    ListSessions' continuation_ids names continuations a selector still resolves, and the
    session's own list stays within the bound instead of growing with every call it ever made
    (before: all 40 were kept in the session's list, and listed, after 30 had been forgotten)."""
    harness = make_harness(max_index_continuations=10)
    prefix = [h(700 + k) for k in range(2)]
    for i in range(40):
        harness.engine.store(prefix, session="agent", continuation=f"c{i}", prefix_hit=i > 0)
    known = set(harness.engine.run(lambda: list(harness.core.index.continuations)))
    listed = harness.engine.run(lambda: set(harness.core.index.sessions["agent"].continuations))
    assert listed == known and len(known) <= 10 and "c39" in known and "c0" not in known
    (info,) = harness.stub.ListSessions(pb.ListSessionsRequest(), timeout=5).sessions
    assert set(info.continuation_ids) <= known and "c0" not in info.continuation_ids
    for c in info.continuation_ids:  # every listed continuation resolves
        sel = pb.Selector(continuation=pb.ContinuationSelector(continuation_id=c))
        assert [b.block_hash for b in harness.stub.QueryResidency(pb.QueryResidencyRequest(selector=sel), timeout=5).blocks] == prefix


def test_the_index_forgets_the_least_recently_active_sessions_past_its_cap(make_harness):
    harness = make_harness(max_index_blocks=10)
    for i, s in enumerate(("old", "mid", "new")):
        harness.engine.store([h(10 * i + k) for k in range(4)], session=s)
        time.sleep(0.01)  # distinct last_active
    # 12 blocks > 10: the oldest session goes; its blocks stay cached but unowned.
    assert sessions(harness) == ["mid", "new"]
    r = harness.apply(pin("old", 10)).results[0]
    assert r.outcome == pb.OUTCOME_MISSING


def test_blocks_that_continuations_hold_count_against_the_block_bound_and_live_sessions_stay(make_harness):
    """Requests with a continuation id and no session hold their chains through the continuation:
    forgetting sessions cannot free those blocks. Past max_index_blocks the index forgets what
    was active longest ago, continuations included, so it comes back under its bound and a
    session that just stored is not forgotten for blocks it never held (before: 16 blocks stayed
    over a bound of 10, and every session's store forgot every live session)."""
    harness = make_harness(max_index_blocks=10)
    for c in range(4):  # 4 chains of 4 blocks, each held by a continuation alone
        harness.engine.store([h(100 * c + k) for k in range(4)], continuation=f"c{c}")
        time.sleep(0.01)  # distinct activity times
    for s in ("alice", "bob"):
        harness.engine.store([h(1000 if s == "alice" else 2000)], session=s)
        time.sleep(0.01)
    assert sessions(harness) == ["alice", "bob"]
    assert harness.engine.run(lambda: len(harness.core.index.nodes)) <= 10
    known = harness.engine.run(lambda: list(harness.core.index.continuations))
    assert known and "c3" in known and "c0" not in known  # the continuation recorded first went first
    cont = pb.Selector(continuation=pb.ContinuationSelector(continuation_id="c3"))
    resp = harness.stub.QueryResidency(pb.QueryResidencyRequest(selector=cont), timeout=5)
    assert [b.block_hash for b in resp.blocks] == [h(300 + k) for k in range(4)]


def test_the_block_bound_forgets_sessions_and_continuations_by_activity(make_harness):
    """An old session goes before a continuation recorded after its last activity, and an old
    continuation before a session active since."""
    harness = make_harness(max_index_blocks=10)
    harness.engine.store([h(10 + k) for k in range(4)], session="old")
    time.sleep(0.01)
    harness.engine.store([h(20 + k) for k in range(4)], continuation="cont")
    time.sleep(0.01)
    harness.engine.store([h(30 + k) for k in range(4)], session="new")
    # 12 blocks > 10: "old" was active before "cont" was recorded, so it goes, and nothing else.
    assert sessions(harness) == ["new"]
    assert harness.engine.run(lambda: list(harness.core.index.continuations)) == ["cont"]
    time.sleep(0.01)
    harness.engine.store([h(40 + k) for k in range(4)], session="newer")
    # 12 again: "cont", recorded before "new" was last active, goes now.
    assert sessions(harness) == ["new", "newer"]
    assert harness.engine.run(lambda: list(harness.core.index.continuations)) == []


# ---- mixed batches against a model of what each hint does
#
# Two sessions over 8 device blocks: a's chain A (6 blocks) and b, which shares A's first `shared`
# blocks and adds 2 of its own; some blocks in use, some pinned beforehand by a block-hash Pin (the
# pin budget is 4, so the batch's Pins can run out of it); the TTL cap is 60 s; 2 hint ids are
# remembered. A batch of up to 5 Retain / Pin / Release / Evict hints on a, b or an unknown
# session, with max_blocks, a TTL over the cap and a few hint ids (re-sent, reused, forgotten), is
# applied at once; a model applies the same hints one after another to the same state and says
# each hint's outcome, reason, clips and blocks applied to, and the state the batch leaves (device
# blocks, their retention class, their sessions). Before it, the only random test here sent one
# Pin or Evict with max_blocks: every example was CLIPPED/MAX_BLOCKS, in a batch of one hint.

_A = [h(i) for i in range(1, 7)]
_B_OWN = [h(20), h(21)]
_PIN_BUDGET = 4  # pin_budget_fraction 0.4 of the 10 usable device blocks
_TTL_CAP = 60.0
_PRE = "pre"  # the owner of the block-hash Pin made before the batch
_ID_WINDOW = 2  # hint ids remembered: the batch's three ids can push one out

_hint_tuples = st.tuples(
    st.sampled_from(["retain", "pin", "pin", "release", "evict", "evict"]),
    st.sampled_from(["a", "a", "b", "b", "ghost"]),
    st.sampled_from([0, 0, 1, 2, 3]),  # max_blocks
    st.booleans(),  # a TTL over the cap (Retain, Pin)
    st.sampled_from(["", "", "x", "y"]),  # hint ids: reused for another hint (conflict)
)


@st.composite
def _batches(draw: st.DrawFn) -> list[tuple]:
    """Up to 5 hints; half the time one of them is re-sent later in the batch, with an id."""
    batch = draw(st.lists(_hint_tuples, min_size=1, max_size=5))
    if len(batch) >= 2 and draw(st.booleans()):
        j = draw(st.integers(0, len(batch) - 2))
        batch[j] = batch[j][:4] + ("r",)
        batch[draw(st.integers(j + 1, len(batch) - 1))] = batch[j]
    return batch


class _Model:
    """What the executor should do, one hint at a time (device tier only, no tenancy)."""

    def __init__(self, shared: int, in_use: set[bytes], pre_pinned: list[bytes]) -> None:
        self.pos = {x: i for i, x in enumerate(_A)} | {x: shared + j for j, x in enumerate(_B_OWN)}
        self.device = {x: x in in_use for x in _A + _B_OWN}
        self.members = {"a": set(_A), "b": set(_A[:shared]) | set(_B_OWN)}
        self.grants: dict[str, dict[bytes, bool]] = {_PRE: dict.fromkeys(pre_pinned, True)} if pre_pinned else {}
        self.seen: OrderedDict[str, tuple[tuple, tuple]] = OrderedDict()  # the idempotency window, oldest first
        self.demoted_first: list[bytes] = []

    def pinned(self, x: bytes, but: str | None = None) -> bool:
        return any(g.get(x) for o, g in self.grants.items() if o != but)

    def resolve(self, s: str) -> list[bytes]:
        return sorted(self.members.get(s, ()), key=self.pos.__getitem__)

    def apply(self, hint: tuple) -> tuple:
        """(outcome, reason, clips, device blocks applied to, replayed, effective ttl)."""
        action, s, max_blocks, over, hint_id = hint
        content = (action, s, max_blocks, over and action in ("retain", "pin"))  # what the id binds to
        if hint_id in self.seen:
            bound, first = self.seen[hint_id]
            if content != bound:
                return (pb.OUTCOME_REJECTED, pb.REASON_HINT_ID_CONFLICT, [], 0, False, None)
            self.seen.move_to_end(hint_id)  # used again: the most recent
            return first[:4] + (True,) + first[5:]
        result = getattr(self, action)(s, max_blocks, over)
        if hint_id:
            self.seen[hint_id] = (content, result)
            while len(self.seen) > _ID_WINDOW:
                self.seen.popitem(last=False)  # forgotten: the id binds again when re-sent
        return result

    @staticmethod
    def outcome(clips: list, applied: int, ttl: float | None = None) -> tuple:
        if clips:
            return (pb.OUTCOME_CLIPPED, clips[0][0], clips, applied, False, ttl)
        return (pb.OUTCOME_ACCEPTED, pb.REASON_UNSPECIFIED, clips, applied, False, ttl)

    def cap(self, hashes: list[bytes], max_blocks: int, from_end: bool, clips: list) -> list[bytes]:
        if max_blocks and len(hashes) > max_blocks:
            clips.append((pb.REASON_MAX_BLOCKS, len(hashes), max_blocks))
            return hashes[-max_blocks:] if from_end else hashes[:max_blocks]
        return hashes

    def grant(self, s: str, max_blocks: int, over: bool, pinned: bool) -> tuple:
        hashes = self.resolve(s)
        if not hashes:
            return (pb.OUTCOME_MISSING, pb.REASON_NOT_RESIDENT, [], 0, False, None)
        clips: list = []
        hashes = self.cap(hashes, max_blocks, False, clips)
        if over:
            clips.append((pb.REASON_TTL_CAPPED, 0, 0))
        if pinned:
            new = [x for x in hashes if not self.pinned(x)]
            headroom = max(0, _PIN_BUDGET - len({x for g in self.grants.values() for x, p in g.items() if p}))
            if len(new) > headroom:
                allowed = set(new[:headroom])
                granted = [x for x in hashes if self.pinned(x) or x in allowed]
                clips.append((pb.REASON_PIN_BUDGET, len(hashes), len(granted)))
                hashes = granted
        if not hashes:
            return self.outcome(clips, 0)
        self.grants.setdefault(s, {}).update(dict.fromkeys(hashes, pinned))
        return self.outcome(clips, len(hashes), _TTL_CAP if over else 30.0)

    def retain(self, s: str, max_blocks: int, over: bool) -> tuple:
        return self.grant(s, max_blocks, over, pinned=False)

    def pin(self, s: str, max_blocks: int, over: bool) -> tuple:
        return self.grant(s, max_blocks, over, pinned=True)

    def release(self, s: str, max_blocks: int, over: bool) -> tuple:
        clips: list = []
        hashes = self.cap(self.resolve(s), max_blocks, True, clips)
        held = self.grants.get(s, {})
        released = {x for x in held if x in hashes} if max_blocks else set(held)
        for x in released:
            del held[x]
        if not held:
            self.grants.pop(s, None)
        if not hashes and not released:
            return (pb.OUTCOME_MISSING, pb.REASON_NOT_RESIDENT, [], 0, False, None)
        moved = [
            x for x in hashes
            if not any(x in g for g in self.grants.values())
            and all(x not in m for t, m in self.members.items() if t != s)
            and not self.device[x]
        ]
        self.demoted_first += moved
        if not max_blocks:
            self.members.pop(s, None)
        return self.outcome(clips, len(released | set(moved)))

    def evict(self, s: str, max_blocks: int, over: bool) -> tuple:
        hashes = self.resolve(s)
        if not hashes:
            return (pb.OUTCOME_MISSING, pb.REASON_NOT_RESIDENT, [], 0, False, None)
        clips: list = []
        hashes = self.cap(hashes, max_blocks, True, clips)
        protected = [x for x in hashes if self.pinned(x, but=s)]
        if protected:
            clips.append((pb.REASON_PINNED_BY_OTHER_SESSION, len(hashes), len(hashes) - len(protected)))
            hashes = [x for x in hashes if x not in protected]
        evicted = [x for x in hashes if not self.device[x]]
        if len(evicted) < len(hashes):
            clips.append((pb.REASON_BLOCKS_IN_USE, len(hashes), len(evicted)))
        for x in evicted:
            del self.device[x]
            for g in self.grants.values():
                g.pop(x, None)
            for m in self.members.values():
                m.discard(x)
        self.grants = {o: g for o, g in self.grants.items() if g}
        return self.outcome(clips, len(evicted))

    def retention_class(self, x: bytes) -> int:
        held = [g[x] for g in self.grants.values() if x in g]
        return R.CLASS_PINNED if any(held) else R.CLASS_RETAINED if held else R.CLASS_ORDINARY


def _wire_hint(action: str, s: str, max_blocks: int, over: bool, hint_id: str) -> pb.Hint:
    ttl = _TTL_CAP * 2 if over else 30.0
    if action == "retain":
        return retain(s, ttl, priority=1, hint_id=hint_id, max_blocks=max_blocks)
    if action == "pin":
        return pin(s, ttl, hint_id=hint_id, max_blocks=max_blocks)
    hint = pb.Hint(hint_id=hint_id, selector=session_sel(s), max_blocks=max_blocks)
    getattr(hint, action).SetInParent()
    return hint


def _observed(r: pb.HintResult) -> tuple:
    clips = [(c.reason, c.requested_blocks, c.granted_blocks) for c in r.clips]
    affected = {c.tier: c.blocks for c in r.affected_blocks}
    assert set(affected) <= {pb.TIER_DEVICE}
    ttl = r.effective_ttl.ToTimedelta().total_seconds() if r.HasField("effective_ttl") else None
    return (r.outcome, r.reason, clips, affected.get(pb.TIER_DEVICE, 0), r.replayed, ttl)


# The pin budget runs out partway through the batch (TTL clip first, then PIN_BUDGET: the blocks
# pinned beforehand cost nothing more); an Evict ends one of b's pins and gives its budget back.
@example(shared=0, in_use=set(), pre_pinned={_A[0], _A[1]}, batch=[
    ("pin", "b", 0, False, ""), ("pin", "a", 0, True, ""), ("evict", "b", 1, False, ""), ("pin", "a", 0, False, "")])
# An Evict clipped three ways, each clip starting from the previous one's granted count.
@example(shared=2, in_use={_A[4]}, pre_pinned={_A[5]}, batch=[("evict", "a", 3, False, ""), ("release", "b", 0, False, "")])
# A re-sent id within the batch replays (nothing re-granted after the Release); reused, it conflicts.
@example(shared=1, in_use={_A[2]}, pre_pinned=set(), batch=[
    ("retain", "a", 2, False, "r"), ("release", "a", 0, False, ""), ("retain", "a", 2, False, "r"),
    ("retain", "a", 1, False, "r"), ("pin", "a", 0, False, "")])
# The id window holds 2: a replay keeps x in it, r pushes y out, and y re-sent is applied again.
@example(shared=0, in_use=set(), pre_pinned=set(), batch=[
    ("retain", "a", 2, False, "x"), ("pin", "b", 1, False, "y"), ("retain", "a", 2, False, "x"),
    ("evict", "b", 1, False, "r"), ("pin", "b", 1, False, "y")])
# The budget is spent by an earlier hint of the batch: a Pin CLIPPED to 0 blocks.
@example(shared=0, in_use=set(), pre_pinned={_A[3], _A[4], _A[5]}, batch=[("pin", "b", 0, False, ""), ("pin", "a", 2, False, "")])
@settings(max_examples=60, deadline=None)
@given(
    shared=st.integers(0, 3),
    in_use=st.sets(st.sampled_from(_A + _B_OWN), max_size=4),
    pre_pinned=st.sets(st.sampled_from(_A + _B_OWN), max_size=3),
    batch=_batches(),
)
def test_a_mixed_batch_gives_each_hint_the_outcome_of_what_it_did(shared, in_use, pre_pinned, batch):
    """Every hint of a batch gets the outcome, reason, clips (each block clip starting from the
    previous one's granted count) and affected count of what it did, given what the hints before
    it in the same batch did; a re-sent id replays, a reused one conflicts; the batch leaves the
    state the model says, and publishes one HintApplied per hint not replayed, in order."""
    harness = Harness(max_ttl_s=_TTL_CAP, pin_budget_fraction=0.4, idempotency_window=_ID_WINDOW)
    try:
        engine = harness.engine
        engine.store(_A, session="a")
        if shared:
            engine.store(_A[:shared], session="b", prefix_hit=True)
        engine.store(_B_OWN, session="b", first_position=shared, parent=_A[shared - 1] if shared else None)
        pre = sorted(pre_pinned, key=(_A + _B_OWN).index)
        if pre:
            sel = pb.Selector(block_hashes=pb.BlockHashSelector(block_hashes=pre))
            assert harness.apply(pb.Hint(selector=sel, pin=pb.PinAction(ttl=duration_pb2.Duration(seconds=60)))).results[0].outcome == pb.OUTCOME_ACCEPTED
        engine.set_in_use(sorted(in_use))
        model = _Model(shared, in_use, pre)
        expected = [model.apply(x) for x in batch]
        before = harness.bus.last_sequence
        resp = harness.apply(*[_wire_hint(*x) for x in batch])

        got = [_observed(r) for r in resp.results]
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert g == e, f"hint {i} {batch[i]} of {batch}: got {g}, the model says {e}"
            # The proto's Clip contract: the last block clip's granted_blocks is what the action
            # applied to (affected_blocks), for every action but Release (ReleaseAction's comment).
            block_clips = [c for c in g[2] if c[0] != pb.REASON_TTL_CAPPED]
            if block_clips and batch[i][0] != "release":
                assert block_clips[-1][2] == g[3], f"hint {i} {batch[i]}: last clip {block_clips[-1]}, affected {g[3]}"
        # Events: one HintApplied per hint not replayed, in request order, the last at applied_at_sequence.
        applied = hint_events(harness, before)
        assert [int(a.result.outcome) for a in applied] == [r.outcome for r in resp.results if not r.replayed]
        assert resp.applied_at_sequence == harness.bus.last_sequence
        # The state the batch left.
        assert set(engine.device) == set(model.device)
        assert engine.demoted_first == model.demoted_first
        if model.device:
            q = harness.stub.QueryResidency(pb.QueryResidencyRequest(
                selector=pb.Selector(block_hashes=pb.BlockHashSelector(block_hashes=list(model.device)))), timeout=5)
            assert {b.block_hash: b.retention.retention_class for b in q.blocks} == {
                x: model.retention_class(x) for x in model.device}
            assert {b.block_hash: set(b.session_ids) for b in q.blocks} == {
                x: {s for s, m in model.members.items() if x in m} for x in model.device}
    finally:
        harness.close()
    assert harness.engine.violations == []
