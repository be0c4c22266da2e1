"""SessionPolicy against an engine that does not take every hint.

The benchmark's simulator accepts every hint; a served engine refuses some
(a Demote with no room on the host tier, a template Retain before its blocks
exist), an RPC can fail, and a router's limit must hold in every second.
Each test drives the policy through `flush` with a sink that answers as an
engine would and checks the hints that reach it.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhint.v1 import kvhint_pb2 as pb
from kvhint_client import continuation
from kvhint_client.policy import (
    ChildJoined,
    ChildSpawned,
    HintRateLimit,
    PolicyConfig,
    RecordingSink,
    RequestSent,
    SessionEnded,
    SessionPolicy,
    TemplateDeclared,
    TemplateRetired,
    ToolCallFinished,
    ToolCallStarted,
)

from test_policy import caps, expected, last_keep, make, train


def actions(sink: RecordingSink, sid: str) -> list[str]:
    return [h.WhichOneof("action") for h in sink.hints if h.selector.session.session_id == sid]


def answering(**by_action: pb.HintResult) -> RecordingSink:
    """A sink that answers each action as given (ACCEPTED otherwise)."""

    def respond(hint: pb.Hint) -> pb.HintResult:
        result = pb.HintResult()
        result.CopyFrom(by_action.get(hint.WhichOneof("action"), pb.HintResult(outcome=pb.OUTCOME_ACCEPTED)))
        result.hint_id = hint.hint_id
        return result

    return RecordingSink(respond)


def demoting_policy() -> tuple[SessionPolicy, float]:
    """A policy on a tiered engine that has learned 'build' pauses last 30 s (Demote from 10 s)."""
    policy, trainer = make(PolicyConfig(use_tiers=True, demote_after_s=10, prefetch_margin_s=2))
    policy.configure(caps(tiers=True))
    return policy, train(policy, trainer, "build", [30.0] * 5, "trainer", 0.0)


# --------------------------------------------------------------------------- refused Demote


def test_a_refused_demote_protects_the_session_on_the_device_for_the_rest_of_the_pause() -> None:
    policy, t = demoting_policy()
    refused = pb.HintResult(outcome=pb.OUTCOME_REJECTED, reason=pb.REASON_RESOURCE_EXHAUSTED)
    sink = answering(demote=refused)
    policy.observe(ToolCallStarted("a", tools=("build",), t=t))
    policy.flush(sink, t)
    assert actions(sink, "a") == ["demote"]
    policy.flush(sink, t + 0.1)
    assert actions(sink, "a") == ["demote", "retain"], "the Retain the Demote replaced comes back at once"
    assert 10 < expected(last_keep(sink, "a")) <= 30  # ranked by its predicted resume, as any paused session
    for dt in (5.0, 20.0, 40.0, 80.0):  # re-predictions of the same pause: no new Demote
        policy.flush(sink, t + dt)
    assert "demote" not in actions(sink, "a")[1:] and "prefetch" not in actions(sink, "a")
    # Its next pause may demote again.
    policy.observe(RequestSent("a", t=t + 90))
    policy.observe(ToolCallStarted("a", tools=("build",), t=t + 91))
    policy.flush(sink, t + 91)
    assert actions(sink, "a")[-1] == "demote"


def test_a_refused_demote_of_an_unsupported_engine_turns_tiers_off() -> None:
    policy, t = demoting_policy()
    sink = answering(demote=pb.HintResult(outcome=pb.OUTCOME_REJECTED, reason=pb.REASON_UNSUPPORTED))
    policy.observe(ToolCallStarted("a", tools=("build",), t=t))
    policy.flush(sink, t)
    policy.flush(sink, t + 0.1)
    assert actions(sink, "a") == ["demote", "retain"] and not policy.tiers


def test_a_demoted_session_whose_tool_returns_early_is_prefetched_at_once() -> None:
    policy, t = demoting_policy()
    sink = RecordingSink()
    policy.observe(ToolCallStarted("a", tools=("build",), t=t))
    policy.flush(sink, t)
    policy.observe(ToolCallFinished("a", t=t + 3.0))  # predicted about 30 s: back early
    policy.flush(sink, t + 3.0)
    assert actions(sink, "a") == ["demote", "retain", "prefetch"]  # (one batch: keeps go before Prefetches)
    assert expected(last_keep(sink, "a")) == pytest.approx(policy.config.resume_s)


def test_a_demoted_parent_that_spawns_a_child_is_prefetched_at_once() -> None:
    """A spawn makes the parent's blocks due at once: the child's first request reads them. A
    parent demoted for a long pause got only a Retain then, with its blocks on the lower tier, and
    its Prefetch stayed scheduled for the pause's predicted resume, long after the child read."""
    policy, t = demoting_policy()
    sink = RecordingSink()
    policy.observe(ToolCallStarted("a", tools=("build",), t=t))
    policy.flush(sink, t)
    policy.observe(ChildSpawned("a", "a.c0", t=t + 3.0))
    policy.flush(sink, t + 3.0)
    assert actions(sink, "a") == ["demote", "retain", "prefetch"]
    assert expected(last_keep(sink, "a")) == pytest.approx(policy.config.resume_s)


# --------------------------------------------------------------------------- failed RPCs


class FailingSink(RecordingSink):
    def __init__(self) -> None:
        super().__init__()
        self.fail = True

    def apply(self, hints):  # type: ignore[no-untyped-def]
        if self.fail:
            raise ConnectionError("engine unavailable")
        return super().apply(hints)


def test_hints_of_a_failed_rpc_go_out_with_the_next_flush() -> None:
    policy, _ = make()
    sink = FailingSink()
    policy.observe(ToolCallStarted("a", t=0.0))
    policy.observe(ToolCallStarted("b", t=0.0))
    policy.observe(SessionEnded("b", t=0.5))
    with pytest.raises(ConnectionError):
        policy.flush(sink, 0.5)
    assert policy.pending == 2 and policy.stats["requeued"] == 2
    sink.fail = False
    policy.flush(sink, 1.0)
    assert actions(sink, "a") == ["retain"] and actions(sink, "b") == ["release"]
    assert sink.hints[0].hint_id != sink.hints[1].hint_id


def test_a_newer_hint_replaces_a_requeued_one() -> None:
    policy, _ = make()
    sink = FailingSink()
    policy.observe(ToolCallStarted("a", t=0.0))
    with pytest.raises(ConnectionError):
        policy.flush(sink, 0.0)
    policy.observe(SessionEnded("a", t=0.2))  # meanwhile the session ended: its keep is moot
    sink.fail = False
    policy.flush(sink, 0.3)
    assert actions(sink, "a") == ["release"]


def test_a_hint_queued_after_a_release_survives_a_failed_rpc_with_it() -> None:
    """A template retired and declared again, and a session that ended and sent a request under
    the same id, before one flush: the batch carries the Release and then the new keep. When that
    RPC failed only the Release was queued again (a queued Release made every keep of its target
    moot, even one newer than it), leaving the template unprotected until its refresh (half its
    TTL) and the revived session until its prediction passed."""
    policy, trainer = make(PolicyConfig(template_ttl_s=100))
    t = train(policy, trainer, "y", [5.0] * 5, "trainer", 0.0)
    policy.observe(TemplateDeclared("sys", continuation("sys-v1"), t=t))
    policy.observe(RequestSent("a", t=t))
    policy.observe(ToolCallStarted("a", tools=("y",), t=t))
    policy.flush(trainer, t)
    policy.observe(TemplateRetired("sys", t=t + 1))
    policy.observe(TemplateDeclared("sys", continuation("sys-v1"), t=t + 1))
    policy.observe(SessionEnded("a", t=t + 1))
    policy.observe(RequestSent("a", t=t + 1))  # the id is used again
    policy.observe(ToolCallStarted("a", tools=("y",), t=t + 1))
    sink = FailingSink()
    with pytest.raises(ConnectionError):
        policy.flush(sink, t + 1)
    sink.fail = False
    policy.flush(sink, t + 1.5)
    assert actions(sink, "a") == ["release", "retain"]
    template = [h.WhichOneof("action") for h in sink.hints if h.selector.continuation.continuation_id == "sys-v1"]
    assert template == ["release", "retain"]


# --------------------------------------------------------------------------- children and templates


def test_a_joined_child_is_released_and_the_parent_is_due_when_the_last_one_joins() -> None:
    policy, sink = make(PolicyConfig(resume_s=0.5))
    policy.observe(ChildSpawned("p", "p.c0", t=0.0))
    policy.observe(ChildSpawned("p", "p.c1", t=0.0))
    policy.observe(RequestSent("p.c0", t=0.1))
    policy.observe(RequestSent("p.c1", t=0.1))
    policy.flush(sink, 0.1)
    policy.observe(ChildJoined("p", "p.c0", t=5.0))
    policy.flush(sink, 5.0)
    assert actions(sink, "p.c0")[-1] == "release" and "p.c0" not in policy.sessions
    assert policy.sessions["p"].state == "waiting"
    policy.observe(ChildJoined("p", "p.c1", t=9.0))
    policy.flush(sink, 9.0)
    assert actions(sink, "p.c1")[-1] == "release"
    assert actions(sink, "p")[-1] == "retain" and expected(last_keep(sink, "p")) == pytest.approx(0.5)
    assert policy.model.count(("children",)) == 1  # the parent's wait, learned once
    policy.observe(RequestSent("p", t=9.2))
    assert policy.model.count(("children",)) == 1
    # A child that ended before it joined is not released twice.
    before = len(sink.hints)
    policy.observe(ChildSpawned("p", "p.c2", t=10.0))
    policy.observe(SessionEnded("p.c2", t=11.0))
    policy.observe(ChildJoined("p", "p.c2", t=11.0))
    policy.flush(sink, 11.0)
    assert actions(sink, "p.c2") == ["release"] and len(sink.hints) > before


def test_a_template_declared_before_its_blocks_exist_is_retried_soon() -> None:
    policy, _ = make(PolicyConfig(template_ttl_s=600, template_retry_s=1.0))
    resident = {"now": False}

    def respond(hint: pb.Hint) -> pb.HintResult:
        outcome = pb.OUTCOME_ACCEPTED if resident["now"] else pb.OUTCOME_MISSING
        return pb.HintResult(hint_id=hint.hint_id, outcome=outcome)

    sink = RecordingSink(respond)
    policy.observe(TemplateDeclared("sys", continuation("sys-v1"), t=0.0))
    sent_at = []
    for k in range(1, 160):
        t = k * 0.1
        if t >= 5.0:
            resident["now"] = True  # its first request has run
        before = len(sink.hints)
        policy.flush(sink, t)
        sent_at += [round(t, 1)] * (len(sink.hints) - before)
    # MISSING at 0.1 -> retry 1 s later, then 2 s, then 4 s (ACCEPTED): then the regular refresh.
    assert sent_at == [0.1, 1.1, 3.1, 7.1]
    policy.flush(sink, 7.1 + 299.0)
    assert len(sink.hints) == 4
    policy.flush(sink, 7.1 + 300.0)
    assert len(sink.hints) == 5


# --------------------------------------------------------------------------- the rate limit


def test_hint_rate_limit_counts_every_one_second_interval() -> None:
    limit = HintRateLimit(rate=10, burst=6)
    assert limit.take(100, 0.0) == 6  # at most burst at once
    assert limit.take(100, 0.5) == 4  # ten in [0, 1)
    assert limit.take(100, 0.99) == 0
    assert limit.take(100, 1.0) == 6  # the first six left the interval
    slow = HintRateLimit(rate=0.5, burst=3)  # below one per second: one per two seconds
    assert [slow.take(5, t) for t in (0.0, 1.0, 1.99, 2.0)] == [1, 0, 0, 1]
    with pytest.raises(ValueError, match="rate"):
        HintRateLimit(rate=0, burst=1)
    with pytest.raises(ValueError, match="burst"):
        HintRateLimit(rate=1, burst=0)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.floats(0, 2)), min_size=1, max_size=30))
def test_policy_sends_at_most_its_rate_in_any_second(steps: list[tuple[int, float]]) -> None:
    rate, burst = 4.0, 3
    policy, sink = make(PolicyConfig(max_hints_per_s=rate, burst=burst))
    t, sent_at = 0.0, []
    for n, dt in steps:
        t += dt
        for i in range(n):
            policy.observe(ToolCallStarted(f"s{i}", tools=("x",), t=t))
        before = len(sink.hints)
        policy.flush(sink, t)
        sent = len(sink.hints) - before
        assert sent <= burst
        sent_at += [t] * sent
    for start in sent_at:
        assert sum(1 for x in sent_at if start <= x < start + 1.0) <= rate
    for k in range(40):  # nothing is lost: coalesced hints wait for the limit and go out later
        policy.flush(sink, t + 1000.0 + k)
    assert policy.pending == 0


def test_a_refusal_that_arrives_after_the_session_resumed_does_not_stop_its_next_demote() -> None:
    policy, t = demoting_policy()
    sink = RecordingSink()
    policy.observe(ToolCallStarted("a", tools=("build",), t=t))
    (demote,) = [h for h in policy.due(t) if h.selector.session.session_id == "a"]
    policy.observe(RequestSent("a", t=t + 1.0))  # resumed before the Demote's answer came back
    policy.record([demote], [pb.HintResult(hint_id=demote.hint_id, outcome=pb.OUTCOME_REJECTED, reason=pb.REASON_RESOURCE_EXHAUSTED)])
    policy.observe(ToolCallStarted("a", tools=("build",), t=t + 2.0))
    policy.flush(sink, t + 2.0)
    assert "demote" in actions(sink, "a")
