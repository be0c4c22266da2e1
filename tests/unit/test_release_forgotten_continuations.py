"""A whole session's Release and the grants of continuations the index's bounds forgot.

The index's bounds (KVHINT_INDEX_MAX_*) may forget a continuation, or the session that listed
it, while the continuation's Retain or Pin lives on. A router that retains by continuation and
releases by session then left those blocks protected until their TTL: the Release found no link
from the session to the continuation any more (its own Release by continuation id still worked).
The executor remembers, per granted continuation, the sessions the index listed it under when it
was granted, and a whole session's Release ends the grants of the forgotten ones it took with it.

Through ApplyHints over real gRPC on the fake engine, as test_release_continuations.py."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvhint_unit_support import h, session_sel
from test_release_continuations import classes, cont_sel, release, retain_cont, store_and_retain

from kvhint.v1 import kvhint_pb2 as pb

R = pb.RetentionState


def test_a_session_release_ends_the_grant_of_a_continuation_the_bounds_forgot(harness):
    chain = [h(1), h(2), h(3)]
    harness.engine.store(chain, session="s", continuation="s/t1")
    assert harness.apply(retain_cont("s/t1")).results[0].outcome == pb.OUTCOME_ACCEPTED
    # The index's continuation bound forgets it; the session and its blocks stay.
    assert harness.engine.run(lambda: harness.core.index.forget_oldest_continuations(1)) == 1
    assert "s" in harness.core.index.sessions and classes(harness, chain) == [R.CLASS_RETAINED] * 3
    r = harness.apply(release(session_sel("s"))).results[0]
    assert r.outcome == pb.OUTCOME_ACCEPTED, r
    assert classes(harness, chain) == [R.CLASS_ORDINARY] * 3
    assert harness.engine.run(lambda: harness.core.ledger.grants) == {}


def test_a_release_of_a_session_the_bounds_forgot_ends_its_continuations_grants(harness):
    """The session itself was forgotten (the session bound), and its continuation with it: the
    Release names a session the index does not know, and still ends what it had granted."""
    chain = [h(1), h(2)]
    harness.engine.store(chain, session="s", continuation="s/t1")
    harness.apply(retain_cont("s/t1"))
    harness.engine.run(lambda: harness.core.index.forget_session("s"))
    r = harness.apply(release(session_sel("s"))).results[0]
    assert r.outcome == pb.OUTCOME_ACCEPTED, r
    assert [(c.tier, c.blocks) for c in r.affected_blocks] == [(pb.TIER_DEVICE, 2)]
    assert classes(harness, chain) == [R.CLASS_ORDINARY] * 2


def test_a_forgotten_continuation_another_live_session_listed_keeps_its_grant(harness):
    chain = [h(1), h(2)]
    harness.engine.store(chain, session="a", continuation="fork")
    harness.engine.store(chain, session="b", continuation="fork", prefix_hit=True)
    harness.apply(retain_cont("fork"))
    harness.engine.run(lambda: harness.core.index.forget_oldest_continuations(1))
    assert harness.apply(release(session_sel("a"))).results[0].outcome == pb.OUTCOME_ACCEPTED
    assert classes(harness, chain) == [R.CLASS_RETAINED] * 2  # b, still tracked, listed it too
    assert harness.apply(release(session_sel("b"))).results[0].outcome == pb.OUTCOME_ACCEPTED
    assert classes(harness, chain) == [R.CLASS_ORDINARY] * 2


def test_a_narrowed_release_and_other_sessions_leave_a_forgotten_continuations_grant(harness):
    chain = [h(1), h(2), h(3)]
    harness.engine.store(chain, session="s", continuation="s/t1")
    harness.engine.store([h(9)], session="other")
    harness.apply(retain_cont("s/t1"))
    harness.engine.run(lambda: harness.core.index.forget_oldest_continuations(1))
    harness.apply(release(session_sel("s", start=1)))  # part of s: s stays, so does the grant
    harness.apply(release(session_sel("other")))
    assert classes(harness, chain) == [R.CLASS_RETAINED] * 3
    # Its own Release by id ends it, and the link goes with its last grant.
    assert harness.apply(release(cont_sel("s/t1"))).results[0].outcome == pb.OUTCOME_ACCEPTED
    assert classes(harness, chain) == [R.CLASS_ORDINARY] * 3

    def links() -> dict:
        harness.core.executor._prune_links()
        return dict(harness.core.executor._continuation_links)

    assert harness.engine.run(links) == {}


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    turns=st.lists(st.tuples(st.sampled_from("abc"), st.integers(1, 4)), min_size=1, max_size=6),
    retained=st.sets(st.integers(0, 5)),
    forgotten=st.integers(0, 6),
    forget_session=st.sampled_from(["", "a", "b", "c"]),
    released=st.sampled_from("abc"),
)
def test_after_a_session_release_no_grant_of_its_continuations_is_left(
        make_harness, turns, retained, forgotten, forget_session, released):
    """Whichever continuations were retained and whatever the index's bounds forgot since
    (continuations, oldest first, and possibly a whole session), a whole session's Release
    leaves no grant held by a continuation recorded under that session (each session's chains
    are its own here, so no other session listed them)."""
    harness = make_harness()
    store_and_retain(harness, turns, retained)
    index = harness.core.index
    harness.engine.run(lambda: index.forget_oldest_continuations(forgotten))
    if forget_session:
        harness.engine.run(lambda: index.forget_session(forget_session))
    harness.apply(release(session_sel(released)))

    def owners_left() -> set[str]:
        return {o for per_block in harness.core.ledger.grants.values() for o in per_block}

    left = harness.engine.run(owners_left)
    assert not {o for o in left if o.startswith(f"c:{released}/")}, left
    # The other sessions' continuations keep theirs.
    kept = {f"c:{s}/t{i}" for i, (s, _) in enumerate(turns) if i in retained and s != released}
    assert kept <= left
