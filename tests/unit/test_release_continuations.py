"""Release and the grants a session's continuations hold (found by trying the README as a new
user: a router that retains by continuation and releases by session left the continuation's
blocks protected until their TTL, and no selector could release them).

Through ApplyHints over real gRPC on the fake engine, as tests/unit/test_executor.py."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from google.protobuf import duration_pb2
from kvhint_unit_support import h, session_sel

from kvhint.v1 import kvhint_pb2 as pb

R = pb.RetentionState


def cont_sel(c: str, **kw) -> pb.Selector:
    return pb.Selector(continuation=pb.ContinuationSelector(continuation_id=c, **kw))


def retain_cont(c: str, priority: int = 5, ttl: int = 300) -> pb.Hint:
    return pb.Hint(selector=cont_sel(c), retain=pb.RetainAction(priority=priority, ttl=duration_pb2.Duration(seconds=ttl)))


def release(selector: pb.Selector, **kw) -> pb.Hint:
    return pb.Hint(selector=selector, release=pb.ReleaseAction(), **kw)


def classes(harness, hashes) -> list[int]:
    q = harness.stub.QueryResidency(pb.QueryResidencyRequest(
        selector=pb.Selector(block_hashes=pb.BlockHashSelector(block_hashes=hashes))), timeout=5)
    by_hash = {b.block_hash: b.retention.retention_class for b in q.blocks}
    return [by_hash[x] for x in hashes]


def test_releasing_a_session_ends_the_retains_of_its_continuations(harness):
    chain = [h(1), h(2), h(3)]
    harness.engine.store(chain, session="cx", continuation="cx/t1")
    assert harness.apply(retain_cont("cx/t1")).results[0].outcome == pb.OUTCOME_ACCEPTED
    assert classes(harness, chain) == [R.CLASS_RETAINED] * 3
    r = harness.apply(release(session_sel("cx"))).results[0]
    assert r.outcome == pb.OUTCOME_ACCEPTED
    assert [(c.tier, c.blocks) for c in r.affected_blocks] == [(pb.TIER_DEVICE, 3)]
    # Nothing stays protected by a continuation that left the index with its session.
    assert classes(harness, chain) == [R.CLASS_ORDINARY] * 3
    assert harness.engine.run(lambda: harness.core.ledger.grants) == {}
    assert harness.engine.demoted_first == chain


def test_a_continuation_another_live_session_lists_keeps_its_retain(harness):
    """A continuation two sessions named (a fork at a shared point) stays in the index while one
    of them lives, and so does its grant."""
    chain = [h(1), h(2)]
    harness.engine.store(chain, session="a", continuation="fork")
    harness.engine.store(chain, session="b", continuation="fork", prefix_hit=True)
    harness.apply(retain_cont("fork"))
    assert harness.apply(release(session_sel("a"))).results[0].outcome == pb.OUTCOME_ACCEPTED
    assert classes(harness, chain) == [R.CLASS_RETAINED] * 2
    assert harness.apply(release(session_sel("b"))).results[0].outcome == pb.OUTCOME_ACCEPTED
    assert classes(harness, chain) == [R.CLASS_ORDINARY] * 2


def test_a_narrowed_session_release_leaves_continuation_grants(harness):
    """A Release of part of a session (a range, max_blocks) keeps the session in the index, and
    its continuations' grants with it."""
    chain = [h(1), h(2), h(3)]
    harness.engine.store(chain, session="s", continuation="s/t1")
    harness.apply(retain_cont("s/t1"))
    harness.apply(release(session_sel("s", start=1)))
    assert classes(harness, chain) == [R.CLASS_RETAINED] * 3


def test_a_continuation_release_ends_its_grants_after_it_left_the_index(harness):
    """A continuation the index stopped tracking (here: its only session was forgotten by the
    index's session bound) still holds its grants until they end; a Release naming it ends them
    rather than answering that no retention is held."""
    chain = [h(1), h(2)]
    harness.engine.store(chain, session="s", continuation="s/t1")
    harness.apply(retain_cont("s/t1"))
    harness.engine.run(lambda: harness.core.index.forget_session("s"))
    assert harness.stub.QueryResidency(pb.QueryResidencyRequest(selector=cont_sel("s/t1")), timeout=5).blocks == []
    assert classes(harness, chain) == [R.CLASS_RETAINED] * 2
    r = harness.apply(release(cont_sel("s/t1"))).results[0]
    assert r.outcome == pb.OUTCOME_ACCEPTED, r
    assert [(c.tier, c.blocks) for c in r.affected_blocks] == [(pb.TIER_DEVICE, 2)]
    assert classes(harness, chain) == [R.CLASS_ORDINARY] * 2


def store_and_retain(harness, turns: list[tuple[str, int]], retained: set[int]) -> None:
    """Turn i of session s stores n blocks of its own chain as continuation `s/ti`; the turns
    whose index is in `retained` are then retained by continuation."""
    for i, (s, n) in enumerate(turns):
        harness.engine.store([h(1000 * (ord(s) - 96) + k) for k in range(n)], session=s, continuation=f"{s}/t{i}")
    for i in sorted(retained):
        if i < len(turns):
            harness.apply(retain_cont(f"{turns[i][0]}/t{i}"))


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    turns=st.lists(st.tuples(st.sampled_from("abc"), st.integers(1, 4)), min_size=1, max_size=6),
    retained=st.sets(st.integers(0, 5)),
    released=st.sampled_from("abc"),
)
def test_after_a_session_release_every_grant_left_is_reachable_by_a_selector(make_harness, turns, retained, released):
    """Whatever sessions and continuations recorded and whichever continuations were retained,
    after a whole session's Release every block still protected is protected by a grant whose
    owner a selector still resolves: a live session, or a continuation the index still tracks."""
    harness = make_harness()
    store_and_retain(harness, turns, retained)
    harness.apply(release(session_sel(released)))

    def unreachable() -> list[str]:
        index, ledger = harness.core.index, harness.core.ledger
        owners = {o for per_block in ledger.grants.values() for o in per_block}
        return sorted(o for o in owners if not (
            (o.startswith("s:") and o[2:] in index.sessions) or (o.startswith("c:") and o[2:] in index.continuations)))

    assert harness.engine.run(unreachable) == []


@pytest.mark.parametrize("action", ["evict", "pin"])
def test_a_hint_on_a_released_session_says_the_index_no_longer_knows_it(harness, action):
    """After a Release the session's blocks may still be cached, but the session is no longer in
    the index: the MISSING result says so rather than that nothing is resident."""
    harness.engine.store([h(1), h(2)], session="gone", continuation="gone/t1")
    harness.apply(release(session_sel("gone")))
    body = {"evict": {"evict": pb.EvictAction()},
            "pin": {"pin": pb.PinAction(ttl=duration_pb2.Duration(seconds=5))}}[action]
    for selector, named in ((session_sel("gone"), "session 'gone'"), (cont_sel("gone/t1"), "continuation 'gone/t1'")):
        r = harness.apply(pb.Hint(selector=selector, **body)).results[0]
        assert (r.outcome, r.reason) == (pb.OUTCOME_MISSING, pb.REASON_NOT_RESIDENT)
        assert f"{named} is not in the index" in r.message, r.message
    # A known session whose selection holds nothing resident keeps the plain message.
    harness.engine.store([h(3)], session="live")
    r = harness.apply(pb.Hint(selector=session_sel("live", start=5), **body)).results[0]
    assert r.outcome == pb.OUTCOME_MISSING and "not in the index" not in r.message
