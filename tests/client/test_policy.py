"""kvhint_client.policy: what a router embedding SessionPolicy observes on the wire.

Learning: pause estimates follow the observed gaps per tool (and fall back
to the prior without data). Ranking: paused sessions expected back sooner
get earlier expected_reuse_in, so the engine keeps them longer. Plus the
contract around it: refresh of passed expectations, Release of ended
sessions and dead branches, the rate limit, tiers, pins within the budget,
and feedback from CLIPPED / REJECTED / MISSING results.
"""

from __future__ import annotations

import asyncio
import math
import random
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhint.v1 import kvhint_pb2 as pb
from kvhint_client import continuation
from kvhint_client.durations import duration_to_seconds
from kvhint_client.policy import (
    ChildJoined,
    ChildSpawned,
    FleetSink,
    LogNormalPrior,
    PauseModel,
    PolicyConfig,
    RecordingSink,
    RequestCompleted,
    RequestSent,
    SessionEnded,
    SessionPolicy,
    TemplateDeclared,
    TemplateRetired,
    TokenBucket,
    ToolCallFinished,
    ToolCallStarted,
)

ALL = (("all",),)


def make(config: PolicyConfig | None = None) -> tuple[SessionPolicy, RecordingSink]:
    return SessionPolicy(config or PolicyConfig(), clock=lambda: 0.0, id_prefix="h"), RecordingSink()


def expected(hint: pb.Hint) -> float | None:
    action = hint.retain if hint.HasField("retain") else hint.pin
    return duration_to_seconds(action.expected_reuse_in) if action.HasField("expected_reuse_in") else None


def last_keep(sink: RecordingSink, sid: str) -> pb.Hint:
    keeps = [h for h in sink.hints if h.selector.session.session_id == sid and h.WhichOneof("action") in ("retain", "pin")]
    assert keeps, f"no keep hint for {sid}"
    return keeps[-1]


def train(policy: SessionPolicy, sink: RecordingSink, tool: str, durations: list[float], sid: str, t0: float) -> float:
    """Run `sid` through one pause per duration on `tool`; returns the time after the last one."""
    t = t0
    for d in durations:
        policy.observe(ToolCallStarted(sid, tools=(tool,), t=t))
        policy.flush(sink, t)
        t += d
        policy.observe(RequestSent(sid, t=t))
        t += 0.1
    return t


# --------------------------------------------------------------------------- learning


def test_prior_decides_without_data_and_data_decides_with_it() -> None:
    model = PauseModel(LogNormalPrior(median_s=5.0, sigma=1.0), prior_weight=2.0)
    assert model.quantile(ALL, 0.5) == pytest.approx(5.0, rel=1e-3)
    rng = random.Random(1)
    for _ in range(200):
        model.observe(ALL, math.exp(rng.gauss(math.log(0.8), 0.3)))
    assert model.quantile(ALL, 0.5) == pytest.approx(0.8, rel=0.1)


def test_residual_grows_for_a_pause_that_outlives_its_class() -> None:
    """A bimodal tool (mostly 1 s, sometimes 30 s): after 3 s the pause is probably a slow one."""
    model = PauseModel(window=512)
    for i in range(300):
        model.observe(ALL, 30.0 if i % 10 == 0 else 1.0)
    assert model.residual(ALL, 0.0) == pytest.approx(1.0, abs=0.05)
    assert model.residual(ALL, 3.0) == pytest.approx(27.0, rel=0.05)


def test_specific_keys_win_once_they_have_data() -> None:
    model = PauseModel(min_samples=3)
    model.observe([("tool", "a"), ALL[0]], 1.0)
    model.observe([("tool", "a"), ALL[0]], 1.0)
    for _ in range(20):
        model.observe([("tool", "b"), ALL[0]], 20.0)
    keys = (("tool", "a"), ALL[0])
    assert model.quantile(keys, 0.5) > 10  # 2 samples of "a" are not enough: backs off to "all"
    model.observe([("tool", "a"), ALL[0]], 1.0)
    assert model.quantile(keys, 0.5) < 2


def test_window_forgets_old_behaviour() -> None:
    model = PauseModel(window=16)
    for _ in range(16):
        model.observe(ALL, 50.0)
    for _ in range(16):
        model.observe(ALL, 0.5)
    assert model.quantile(ALL, 0.5) < 1.0


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(0.01, 100), min_size=1, max_size=40),
    st.floats(0, 200),
    st.floats(0.05, 0.95),
)
def test_residual_is_a_valid_conditional_quantile(sample: list[float], elapsed: float, q: float) -> None:
    model = PauseModel(min_samples=1)
    for x in sample:
        model.observe(ALL, x)
    r = model.residual(ALL, elapsed, q=q)
    assert r >= 0 and math.isfinite(r)
    # Shifting every observation later never predicts an earlier end.
    later = PauseModel(min_samples=1)
    for x in sample:
        later.observe(ALL, x * 2)
    assert later.residual(ALL, 0.0, q=q) >= model.residual(ALL, 0.0, q=q) - 1e-6


def test_pauses_that_ended_their_session_make_the_prediction_never() -> None:
    """A key whose pauses mostly ended the session (no next request) predicts "never":
    residual infinite once more than 1 - q of the pauses that lasted this long did not come
    back, and the reuse index too once no finite pause is left beyond the time waited."""
    model = PauseModel(min_samples=1, prior_weight=1.0)
    for _ in range(2):
        model.observe(ALL, 4.0)
    assert math.isfinite(model.residual(ALL, 0.0, q=0.7))
    for _ in range(8):
        model.observe_end(ALL)
    assert model.residual(ALL, 0.0, q=0.7) == math.inf  # 8 of 11 never come back
    assert model.residual(ALL, 0.0, q=0.1) == pytest.approx(4.0, rel=1e-3)  # a low quantile still sees the 4 s pauses
    index, horizon = model.reuse_index(ALL, 0.0)
    assert math.isfinite(index) and index > 4.0  # the never-mass is space held for no hit
    only_never = PauseModel(min_samples=1, prior_weight=1e-9)
    only_never.observe_end(ALL)
    assert only_never.reuse_index(ALL, 1e6) == (math.inf, math.inf)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.one_of(st.floats(0.01, 100), st.just(math.inf)), min_size=1, max_size=40),
    st.floats(0, 200),
    st.floats(0.05, 0.95),
)
def test_residual_with_sessions_that_ended_is_a_quantile_or_never(sample: list[float], elapsed: float, q: float) -> None:
    """With never-observations (inf) in the sample the residual is still the conditional
    q-quantile: infinite exactly when the share of pauses that lasted `elapsed` and never came
    back exceeds 1 - q, finite and >= 0 otherwise; a pause ending its session only ever makes
    the prediction later."""
    model = PauseModel(min_samples=1)
    finite_only = PauseModel(min_samples=1)
    for x in sample:
        if math.isinf(x):
            model.observe_end(ALL)
        else:
            model.observe(ALL, x)
            finite_only.observe(ALL, x)
    w = model.prior_weight
    survivors = sum(1 for x in sample if x > elapsed) + w * (1 - model.prior.cdf(elapsed))
    never = sum(1 for x in sample if math.isinf(x))
    r = model.residual(ALL, elapsed, q=q)
    assert r >= 0
    if never / survivors > 1 - q + 1e-9:
        assert r == math.inf
    elif never / survivors < 1 - q - 1e-9:
        assert math.isfinite(r)
    if math.isfinite(r) and finite_only.count(ALL):
        assert r >= finite_only.residual(ALL, elapsed, q=q) - 1e-6


# --------------------------------------------------------------------------- ranking


def test_reuse_index_of_a_known_duration_is_that_duration() -> None:
    model = PauseModel(min_samples=1, prior_weight=1e-6)
    model.observe(ALL, 10.0)
    index, horizon = model.reuse_index(ALL, 4.0)
    assert index == pytest.approx(6.0, rel=1e-3) and horizon >= 6.0 - 1e-9  # held at least until it is due


def test_reuse_index_ranks_a_usually_quick_call_by_its_quick_mode_then_gives_up() -> None:
    """90% back in ~1 s, 10% in ~60 s: the conditional 0.7-quantile says ~1 s too, but with
    40% slow the quantile jumps to the slow mode while the index still favours the quick one."""
    quick_often = PauseModel(min_samples=1, prior_weight=1e-6)
    for d in [1.0] * 6 + [60.0] * 4:
        quick_often.observe(ALL, d)
    steady = PauseModel(min_samples=1, prior_weight=1e-6)
    for d in [20.0] * 10:
        steady.observe(ALL, d)
    assert quick_often.residual(ALL, 0.0, q=0.7) > steady.residual(ALL, 0.0, q=0.7)  # the quantile: slow
    index, horizon = quick_often.reuse_index(ALL, 0.0)
    assert index < steady.reuse_index(ALL, 0.0)[0]  # the index: kept over the steady 20 s call
    assert 1.0 <= horizon < 2.0  # ... until its quick mode is spent
    later, _ = quick_often.reuse_index(ALL, 1.5)
    assert later == pytest.approx(58.5, rel=1e-3)  # then it is the slow call


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.01, 500), min_size=1, max_size=30), st.floats(0, 600))
def test_reuse_index_is_bounded_by_the_remaining_durations(sample: list[float], elapsed: float) -> None:
    model = PauseModel(min_samples=1)
    for x in sample:
        model.observe(ALL, x)
    index, horizon = model.reuse_index(ALL, elapsed)
    assert 0 <= index and 0 <= horizon
    remaining = [x - elapsed for x in sample if x > elapsed]
    if remaining and len(remaining) == len(sample):  # nothing seen has ended yet
        # never later than the mean remaining time of what was seen and the prior (h = the largest)
        assert index <= max(remaining) + model.prior.quantile(1 - 0.5 / model.prior_points)


@pytest.mark.parametrize("ranking", ["quantile", "index"])
def test_sessions_on_faster_tools_are_expected_back_sooner(ranking: str) -> None:
    policy, sink = make(PolicyConfig(ranking=ranking))
    t = train(policy, sink, "grep", [0.4, 0.5, 0.6, 0.5, 0.45], "a", 0.0)
    t = train(policy, sink, "run_tests", [20, 25, 30, 22, 28], "b", t)
    policy.observe(ToolCallStarted("b", tools=("run_tests",), t=t))
    policy.observe(ToolCallStarted("a", tools=("grep",), t=t))
    policy.flush(sink, t)
    assert [sid for sid, _ in policy.ranking(t)] == ["a", "b"]
    fast, slow = expected(last_keep(sink, "a")), expected(last_keep(sink, "b"))
    assert fast is not None and slow is not None
    # Near each tool's observed durations (the prior, worth two observations, pulls a little).
    assert fast == pytest.approx(0.5, abs=0.3) and slow == pytest.approx(25, rel=0.2)
    # Same priority: the engine orders the two by expected reuse alone.
    assert last_keep(sink, "a").retain.priority == last_keep(sink, "b").retain.priority


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["t1", "t2", "t3"]), st.floats(0.1, 60)), min_size=3, max_size=40))
def test_index_ranking_follows_the_learned_estimates(history: list[tuple[str, float]]) -> None:
    policy, sink = make(PolicyConfig(ranking="index"))
    t = 0.0
    for tool, d in history:
        t = train(policy, sink, tool, [d], "trainer", t)
    tools = sorted({tool for tool, _ in history})
    for tool in tools:
        policy.observe(ToolCallStarted(f"s-{tool}", tools=(tool,), t=t))
    ranked = policy.ranking(t)
    assert {sid for sid, _ in ranked} >= {f"s-{tool}" for tool in tools}
    times = [at for _, at in ranked]
    assert times == sorted(times)
    for tool in tools:  # each paused session is predicted at its tool's learned reuse index
        sid = f"s-{tool}"
        keys = policy.sessions[sid].keys
        assert dict(ranked)[sid] == pytest.approx(t + policy.model.reuse_index(keys, 0.0)[0])


@settings(max_examples=20, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["t1", "t2"]), st.floats(0.1, 60)), min_size=2, max_size=20))
def test_quantile_ranking_predicts_the_conditional_quantile(history: list[tuple[str, float]]) -> None:
    policy, sink = make(PolicyConfig(ranking="quantile", quantile=0.6))
    t = 0.0
    for tool, d in history:
        t = train(policy, sink, tool, [d], "trainer", t)
    policy.observe(ToolCallStarted("s", tools=(history[0][0],), t=t))
    keys = policy.sessions["s"].keys
    assert policy.predicted_resume("s", t) == pytest.approx(t + policy.model.residual(keys, 0.0, q=0.6))


def test_unknown_ranking_is_refused() -> None:
    with pytest.raises(ValueError, match="ranking"):
        SessionPolicy(PolicyConfig(ranking="median"))


@pytest.mark.parametrize("ranking", ["quantile", "index"])
def test_passed_expectation_is_refreshed_with_a_later_one(ranking: str) -> None:
    policy, sink = make(PolicyConfig(ranking=ranking))
    t = train(policy, sink, "flaky", [1.0] * 9 + [30.0] * 1, "a", 0.0)
    policy.observe(ToolCallStarted("a", tools=("flaky",), t=t))
    policy.flush(sink, t)
    first = expected(last_keep(sink, "a"))
    assert first is not None and first < 3
    policy.flush(sink, t + 5.0)  # still paused well past the prediction
    second = expected(last_keep(sink, "a"))
    assert second is not None and second > 5  # the quick mode is spent: now expected back much later


def test_children_wait_is_learned_and_parent_kept() -> None:
    policy, sink = make()
    policy.observe(ChildSpawned("p", "p.c0", t=0.0))
    policy.observe(RequestSent("p.c0", t=0.1))
    policy.flush(sink, 0.1)
    assert last_keep(sink, "p").HasField("retain")
    policy.observe(SessionEnded("p.c0", t=4.0))
    policy.observe(ChildJoined("p", "p.c0", t=4.0))
    policy.observe(RequestSent("p", t=4.0))
    assert policy.model.count(("children",)) == 1


# --------------------------------------------------------------------------- lifecycle


def test_ended_session_and_its_dead_branches_are_released_and_forgotten() -> None:
    policy, sink = make()
    policy.observe(ToolCallStarted("p", tools=("x",), t=0.0))
    policy.observe(ChildSpawned("p", "p.c0", t=0.0))
    policy.observe(ChildSpawned("p", "p.c1", t=0.0))
    policy.observe(SessionEnded("p", t=1.0))
    policy.flush(sink, 1.0)
    released = {h.selector.session.session_id for h in sink.hints if h.HasField("release")}
    assert released == {"p", "p.c0", "p.c1"}
    assert not any(h.HasField("retain") for h in sink.hints), "a Release cancels the keep queued for the same session"
    assert policy.sessions == {}


def test_tool_finished_means_imminent_reuse_and_is_learned() -> None:
    policy, sink = make(PolicyConfig(resume_s=0.5))
    policy.observe(ToolCallStarted("a", tools=("x",), t=0.0))
    policy.observe(ToolCallFinished("a", t=3.0))
    policy.flush(sink, 3.0)
    assert expected(last_keep(sink, "a")) == pytest.approx(0.5)
    policy.observe(RequestSent("a", t=3.2))
    assert policy.model.count(("tool", "x")) == 1  # the tool's own duration, learned once


def _keeps(sink: RecordingSink, sid: str) -> list[float | None]:
    return [expected(h) for h in sink.hints if h.selector.session.session_id == sid and h.WhichOneof("action") in ("retain", "pin")]


def test_imminent_reuse_stays_imminent_until_the_request_comes_for_at_most_resume_wait_s() -> None:
    """A parent whose spawned children have not started yet (they read its context first), or a
    session whose tool call finished, is due now. In a busy engine that request waits in the
    queue; an expectation that passes ranks the blocks first for eviction, so the policy keeps
    re-sending "due in resume_s" until the request comes, and gives up after resume_wait_s."""
    policy, sink = make(PolicyConfig(resume_s=1.0, refresh_lead_s=0.25, resume_wait_s=10.0))
    policy.observe(ChildSpawned("p", "p.c0", t=0.0))
    policy.observe(ToolCallStarted("a", tools=("x",), t=0.0))
    policy.observe(ToolCallFinished("a", t=0.0))
    for t in (0.0, 0.5, 1.0, 2.0, 5.0):
        policy.flush(sink, t)
    assert _keeps(sink, "p") == [1.0] * 4 and _keeps(sink, "a") == [1.0] * 4  # at 0, 1, 2 and 5 s
    for t in range(6, 30):
        policy.flush(sink, float(t))
    assert len(_keeps(sink, "p")) == len(_keeps(sink, "a")) == 4 + 5  # 6..10 s, then no more
    policy.observe(RequestSent("p.c0", t=30.0))  # the child starts: the parent's own wait begins
    policy.flush(sink, 30.0)
    assert _keeps(sink, "p")[-1] != 1.0


def test_a_request_sent_after_a_pause_keeps_its_session_due_until_it_completes() -> None:
    """The engine reads a resumed session's blocks when it admits the request, and a busy engine
    queues it: until it completes the session stays due (within as long as the request has
    waited, re-sent as that passes, for at most resume_wait_s), instead of keeping the pause's
    expectation, which by then is passed (ranked first for eviction) or later than now (ranked
    before sessions due sooner)."""
    policy, sink = make(PolicyConfig(resume_s=1.0, refresh_lead_s=0.25, resume_wait_s=10.0))
    policy.observe(ToolCallStarted("a", tools=("x",), t=0.0))
    policy.observe(RequestSent("new", t=0.0))  # a session's first request: nothing of it to keep
    policy.flush(sink, 0.0)
    assert expected(last_keep(sink, "a")) > 1.0 and not _keeps(sink, "new")
    policy.observe(RequestSent("a", t=2.0))
    for t in range(2, 20):
        policy.flush(sink, float(t))
    # At the send, then as each expectation passes: 1 s, 2 s, 4 s and 8 s after it (a request
    # running for a long time costs a few refreshes); the next would be 16 s after, past
    # resume_wait_s.
    assert _keeps(sink, "a")[1:] == [1.0, 1.0, 2.0, 4.0, 8.0]
    policy.observe(RequestCompleted("a", t=20.0))
    policy.observe(ToolCallStarted("a", tools=("x",), t=20.0))
    policy.flush(sink, 20.0)
    n = len(_keeps(sink, "a"))
    assert _keeps(sink, "a")[-1] > 1.0  # paused again: the pause's prediction
    for t in range(21, 25):
        policy.flush(sink, float(t))
    assert len(_keeps(sink, "a")) == n  # not kept due while paused


def test_without_keep_while_running_a_sent_request_sends_nothing() -> None:
    policy, sink = make(PolicyConfig(keep_while_running=False))
    policy.observe(ToolCallStarted("a", tools=("x",), t=0.0))
    policy.flush(sink, 0.0)
    policy.observe(RequestSent("a", t=2.0))
    for t in range(2, 10):
        policy.flush(sink, float(t))
    assert len(_keeps(sink, "a")) == 1


def test_idle_session_after_completion_is_kept_until_a_tool_call_replaces_it() -> None:
    policy, sink = make()
    policy.observe(RequestSent("a", t=0.0))
    policy.observe(RequestCompleted("a", t=1.0))
    policy.observe(ToolCallStarted("a", tools=("x",), t=1.0))
    policy.flush(sink, 1.0)
    assert len([h for h in sink.hints if h.selector.session.session_id == "a"]) == 1  # coalesced


def _releases(sink: RecordingSink, sid: str) -> int:
    return sum(1 for h in sink.hints if h.selector.session.session_id == sid and h.HasField("release"))


def test_an_idle_session_like_those_that_ended_is_released_once_and_revived_by_a_request() -> None:
    """Sessions that answered with no tool call and then ended teach the policy that idle
    pauses do not come back. An idle session whose user left (no SessionEnded ever) is then
    released once, instead of being protected above running sessions until its TTL runs out;
    its next request makes it a live session again."""
    policy, sink = make()
    t = 0.0
    for i in range(6):  # six sessions: one answer, then the end
        policy.observe(RequestSent(f"done-{i}", t=t))
        policy.observe(RequestCompleted(f"done-{i}", t=t + 1))
        policy.observe(SessionEnded(f"done-{i}", t=t + 2))
        t += 3
    assert policy.model.residual((("idle", ""), ("idle",)), 0.0, q=0.7) == math.inf
    policy.observe(RequestSent("left", t=t))
    policy.observe(RequestCompleted("left", t=t + 1))
    for dt in (1, 2, 30, 300):
        policy.flush(sink, t + dt)
    assert _releases(sink, "left") == 1 and _keeps(sink, "left") == []
    assert policy.predicted_resume("left", t + 300) == math.inf
    policy.observe(RequestSent("left", t=t + 400))  # it came back after all
    policy.observe(ToolCallStarted("left", tools=("x",), t=t + 401))
    policy.flush(sink, t + 401)
    assert _keeps(sink, "left")  # a tool pause is kept again
    assert policy.model.count(("idle",)) == 7  # the idle pause that did come back is learned


def test_signals_after_a_session_ended_do_not_bring_it_back() -> None:
    """A request that completes after its session's SessionEnded (the runtime ended it while the
    request was in flight) must not make it a paused session that nothing would ever release."""
    policy, sink = make()
    policy.observe(RequestSent("a", t=0.0))
    policy.observe(SessionEnded("a", t=0.5))
    policy.observe(RequestCompleted("a", t=1.0))
    policy.observe(ToolCallStarted("a", tools=("x",), t=1.0))
    policy.observe(ChildSpawned("a", "a.c0", t=1.0))
    policy.observe(SessionEnded("a", t=1.5))
    for t in (1.5, 10.0, 100.0):
        policy.flush(sink, t)
    assert policy.sessions == {}
    assert _keeps(sink, "a") == [] and _releases(sink, "a") == 1
    assert policy.stats["late_signals"] == 4
    policy.observe(RequestSent("a", t=200.0))  # the id is used again: a live session
    policy.observe(RequestCompleted("a", t=201.0))
    policy.flush(sink, 201.0)
    assert "a" in policy.sessions


def test_template_is_kept_above_sessions_refreshed_and_retired() -> None:
    policy, sink = make(PolicyConfig(template_ttl_s=100))
    policy.observe(TemplateDeclared("sys", continuation("sys-v1"), t=0.0))
    policy.observe(ToolCallStarted("a", t=0.0))
    policy.flush(sink, 0.0)
    tmpl = [h for h in sink.hints if h.selector.continuation.continuation_id == "sys-v1"]
    assert len(tmpl) == 1 and tmpl[0].retain.priority > last_keep(sink, "a").retain.priority
    assert not tmpl[0].retain.HasField("expected_reuse_in")
    policy.flush(sink, 49.0)
    assert len([h for h in sink.hints if h.selector.continuation.continuation_id == "sys-v1"]) == 1
    policy.flush(sink, 51.0)
    assert len([h for h in sink.hints if h.selector.continuation.continuation_id == "sys-v1"]) == 2
    policy.observe(TemplateRetired("sys", t=52.0))
    policy.flush(sink, 52.0)
    assert sink.hints[-1].HasField("release") and sink.hints[-1].selector.continuation.continuation_id == "sys-v1"


def test_a_failed_send_does_not_bring_back_a_keep_that_a_release_replaced() -> None:
    """A keep in flight when its target was let go (a template retired, a session predicted
    never to come back) is not requeued if the send fails: the Release queued meanwhile is the
    target's newest intent, and a Retain after it would protect what the router gave up."""
    policy, _sink = make(PolicyConfig(template_ttl_s=100))
    policy.observe(TemplateDeclared("sys", continuation("sys-v1"), t=0.0))
    in_flight = policy.due(0.0)
    assert [h.WhichOneof("action") for h in in_flight] == ["retain"]
    policy.observe(TemplateRetired("sys", t=0.1))  # while the RPC is out
    policy.requeue(in_flight)  # ... and it failed
    assert [h.WhichOneof("action") for h in policy.due(1.0)] == ["release"]


def test_sessions_that_go_quiet_are_forgotten_once_nothing_sent_for_them_can_be_in_effect() -> None:
    """A router that never sends SessionEnded must not keep every session it ever saw: one quiet
    for forget_after_s after its last keep expired goes (its pause counted as one that did not
    come back), and a later request starts it afresh. A parent stays while it has children."""
    policy, sink = make(PolicyConfig(forget_after_s=100.0))
    for i in range(50):
        policy.observe(RequestSent(f"s{i}", t=0.0))
    for i in range(50):
        policy.observe(ToolCallStarted(f"s{i}", tools=("search",), t=1.0))
    policy.observe(ChildSpawned("parent", "child", t=1.0))
    model_before = policy.model.export()
    t, gone_at = 1.0, {}
    while policy.sessions and t < 50_000:
        before = {sid: (max(s.last_signal, s.granted_until), bool(s.children)) for sid, s in policy.sessions.items()}
        policy.flush(sink, t)
        for sid, (quiet_since, had_children) in before.items():
            if sid not in policy.sessions:
                assert t - quiet_since >= 100.0 and not had_children, (sid, t, quiet_since)
                gone_at[sid] = t
        t += 25.0
    assert not policy.sessions and policy.stats.get("forgotten") == 52  # every one, within bounds
    assert gone_at["parent"] > gone_at["child"]
    assert policy.model.export() != model_before  # the pauses counted as ones that did not come back
    policy.observe(RequestSent("s0", t=t))  # back after all: a new session
    assert policy.sessions["s0"].state == "running"


def test_a_session_with_a_hint_waiting_to_be_sent_is_not_forgotten() -> None:
    policy, sink = make(PolicyConfig(forget_after_s=10.0, max_hints_per_s=1.0, burst=1))
    policy.observe(ToolCallStarted("a", t=0.0))
    policy.observe(ToolCallStarted("b", t=0.0))
    policy.flush(sink, 0.0)  # one of the two keeps goes; the other waits for a token
    assert policy.pending == 1
    waiting = next(i.owner for i in policy._outbox.values())
    policy.tick(1000.0)
    assert waiting in policy.sessions


def test_forget_after_s_must_be_positive() -> None:
    with pytest.raises(ValueError, match="forget_after_s"):
        SessionPolicy(PolicyConfig(forget_after_s=0.0))


def test_signals_out_of_order_are_refused() -> None:
    policy, _ = make()
    policy.observe(RequestSent("a", t=5.0))
    with pytest.raises(ValueError, match="time order"):
        policy.observe(RequestSent("a", t=4.0))


# --------------------------------------------------------------------------- rate limit


def test_token_bucket_bounds_the_rate() -> None:
    bucket = TokenBucket(rate=10, burst=5)
    assert bucket.take(100, 0.0) == 5
    assert bucket.take(100, 0.0) == 0
    assert bucket.take(100, 0.35) == 3
    assert bucket.take(100, 100.0) == 5


# --------------------------------------------------------------------------- engine support and results


def caps(expected_reuse: bool = True, tiers: bool = False, pin_budget: int = 0, max_ttl: float = 3600) -> pb.GetCapabilitiesResponse:
    actions = [
        pb.ActionSupport(action=pb.ACTION_RETAIN, supported=True, supports_expected_reuse=expected_reuse),
        pb.ActionSupport(action=pb.ACTION_PIN, supported=True, supports_expected_reuse=expected_reuse),
        pb.ActionSupport(action=pb.ACTION_DEMOTE, supported=tiers),
        pb.ActionSupport(action=pb.ACTION_PREFETCH, supported=tiers),
    ]
    limits = pb.Limits(pin_budget_blocks=pin_budget, max_hints_per_batch=8)
    limits.max_ttl.FromSeconds(int(max_ttl))
    return pb.GetCapabilitiesResponse(actions=actions, limits=limits)


def test_engine_without_expected_reuse_gets_priority_bands() -> None:
    policy, sink = make()
    policy.configure(caps(expected_reuse=False, max_ttl=60))
    t = train(policy, sink, "fast", [0.5] * 5, "a", 0.0)
    t = train(policy, sink, "slow", [40.0] * 5, "b", t)
    policy.observe(ToolCallStarted("a", tools=("fast",), t=t))
    policy.observe(ToolCallStarted("b", tools=("slow",), t=t))
    policy.flush(sink, t)
    fast, slow = last_keep(sink, "a"), last_keep(sink, "b")
    assert expected(fast) is None and expected(slow) is None
    assert fast.retain.priority > slow.retain.priority
    assert duration_to_seconds(slow.retain.ttl) <= 60


def test_rejected_unsupported_expected_reuse_falls_back() -> None:
    def respond(h: pb.Hint) -> pb.HintResult:
        if h.HasField("retain") and h.retain.HasField("expected_reuse_in"):
            return pb.HintResult(hint_id=h.hint_id, outcome=pb.OUTCOME_REJECTED, reason=pb.REASON_UNSUPPORTED)
        return pb.HintResult(hint_id=h.hint_id, outcome=pb.OUTCOME_ACCEPTED)

    policy, _ = make()
    sink = RecordingSink(respond)
    policy.observe(ToolCallStarted("a", t=0.0))
    policy.flush(sink, 0.0)
    policy.flush(sink, 0.0)
    assert expected(sink.hints[0]) is not None and expected(sink.hints[-1]) is None
    assert policy.stats["OUTCOME_REJECTED"] == 1 and not policy.expected_reuse


def test_missing_session_is_not_refreshed_until_it_runs_again() -> None:
    policy, _ = make()
    sink = RecordingSink(lambda h: pb.HintResult(hint_id=h.hint_id, outcome=pb.OUTCOME_MISSING))
    policy.observe(ToolCallStarted("a", t=0.0))
    policy.flush(sink, 0.0)
    for t in (100.0, 1000.0, 5000.0):
        policy.flush(sink, t)
    assert len(sink.hints) == 1


def test_long_pause_with_tiers_demotes_then_prefetches_before_the_resume() -> None:
    policy, sink = make(PolicyConfig(use_tiers=True, demote_after_s=10, prefetch_margin_s=2))
    policy.configure(caps(tiers=True))
    t = train(policy, sink, "build", [30.0] * 5, "trainer", 0.0)
    policy.observe(ToolCallStarted("a", tools=("build",), t=t))
    policy.flush(sink, t)
    mine = [h for h in sink.hints if h.selector.session.session_id == "a"]
    assert [h.WhichOneof("action") for h in mine] == ["demote"]
    resume = policy.predicted_resume("a", t)
    assert resume is not None
    policy.flush(sink, resume - 2.5)
    assert [h.WhichOneof("action") for h in sink.hints if h.selector.session.session_id == "a"] == ["demote"]
    policy.flush(sink, resume - 1.9)
    assert [h.WhichOneof("action") for h in sink.hints if h.selector.session.session_id == "a"] == ["demote", "prefetch"]


def test_tiers_unsupported_by_the_engine_means_retain() -> None:
    policy, sink = make(PolicyConfig(use_tiers=True, demote_after_s=1))
    policy.configure(caps(tiers=False))
    policy.observe(ToolCallStarted("a", expected_duration_s=100, t=0.0))
    policy.flush(sink, 0.0)
    assert [h.WhichOneof("action") for h in sink.hints] == ["retain"]


def _device(n: int) -> list[pb.TierBlockCount]:
    return [pb.TierBlockCount(tier=pb.TIER_DEVICE, blocks=n)]


def test_pins_stay_inside_the_budget() -> None:
    def respond(h: pb.Hint) -> pb.HintResult:
        return pb.HintResult(hint_id=h.hint_id, outcome=pb.OUTCOME_ACCEPTED, affected_blocks=_device(10))

    policy, _ = make(PolicyConfig(pin_within_s=5.0))
    sink = RecordingSink(respond)
    policy.configure(caps(pin_budget=25))
    for sid in ("a", "b", "c"):  # learn each session's size from a first Retain
        policy.observe(ToolCallStarted(sid, expected_duration_s=1.0, t=0.0))
    policy.flush(sink, 0.0)
    for sid in ("a", "b", "c"):
        policy.observe(RequestSent(sid, t=1.0))
        policy.observe(ToolCallStarted(sid, expected_duration_s=1.0, t=1.0))
    policy.flush(sink, 1.0)
    pins = [h for h in sink.hints[3:] if h.HasField("pin")]
    assert len(pins) == 2  # 2 x 10 blocks fit a budget of 25; the third is retained
    assert sum(s.pinned_blocks for s in policy.sessions.values()) <= 25


def test_pin_budget_clip_stops_pinning() -> None:
    def respond(h: pb.Hint) -> pb.HintResult:
        if h.HasField("pin"):
            return pb.HintResult(hint_id=h.hint_id, outcome=pb.OUTCOME_CLIPPED, affected_blocks=_device(3),
                                 clips=[pb.Clip(reason=pb.REASON_PIN_BUDGET)])
        return pb.HintResult(hint_id=h.hint_id, outcome=pb.OUTCOME_ACCEPTED, affected_blocks=_device(5))

    policy, _ = make(PolicyConfig(pin_within_s=5.0))
    sink = RecordingSink(respond)
    policy.configure(caps(pin_budget=1000))
    for sid in ("a", "b"):
        policy.observe(ToolCallStarted(sid, expected_duration_s=1.0, t=0.0))
    policy.flush(sink, 0.0)
    policy.observe(RequestSent("a", t=1.0))
    policy.observe(ToolCallStarted("a", expected_duration_s=1.0, t=1.0))
    policy.flush(sink, 1.0)
    assert sink.hints[-1].HasField("pin")
    policy.observe(RequestSent("b", t=2.0))
    policy.observe(ToolCallStarted("b", expected_duration_s=1.0, t=2.0))
    policy.flush(sink, 2.0)
    assert sink.hints[-1].HasField("retain")


# --------------------------------------------------------------------------- sinks


def test_fleet_sink_reports_the_most_applied_outcome() -> None:
    results = {
        "h0": {"e1": pb.HintResult(hint_id="h0", outcome=pb.OUTCOME_MISSING), "e2": pb.HintResult(hint_id="h0", outcome=pb.OUTCOME_ACCEPTED)},
        "h1": {},
    }
    answer = SimpleNamespace(results_for=lambda i: results[i], errors={}, routes={"h0": ["e1", "e2"], "h1": []})
    fleet = SimpleNamespace(apply=lambda *hints, timeout=None: answer)
    out = FleetSink(fleet).apply([pb.Hint(hint_id="h0"), pb.Hint(hint_id="h1")])  # type: ignore[arg-type]
    assert [r.outcome for r in out] == [pb.OUTCOME_ACCEPTED, pb.OUTCOME_MISSING]


def test_flush_async_sends_through_an_async_sink() -> None:
    class AsyncSink:
        def __init__(self) -> None:
            self.hints: list[pb.Hint] = []

        async def apply(self, hints):  # type: ignore[no-untyped-def]
            self.hints += hints
            return [pb.HintResult(hint_id=h.hint_id, outcome=pb.OUTCOME_ACCEPTED) for h in hints]

    policy, _ = make()
    sink = AsyncSink()
    policy.observe(ToolCallStarted("a", t=0.0))
    pairs = asyncio.run(policy.flush_async(sink, 0.0))
    assert len(pairs) == 1 and sink.hints[0].HasField("retain") and policy.stats["OUTCOME_ACCEPTED"] == 1


# -- found in review: pauses past the model's range, cold sessions, templates under a short max_ttl


def test_a_pause_past_everything_the_model_can_place_is_let_go_not_kept_due_now() -> None:
    """A user who got an answer and left with no end signal: once the pause outlives what the
    prior can place, its residual used to come out 0 ("due now"), and every flush re-sent a
    Retain with expected_reuse_in=0 and never released it (14,400 hints in an hour). (Kept
    from being forgotten when quiet, so the let-go state itself can be read at the end.)"""
    policy, sink = SessionPolicy(PolicyConfig(forget_after_s=math.inf), clock=lambda: 0.0), RecordingSink()
    policy.observe(RequestSent("u", t=0))
    policy.observe(RequestCompleted("u", t=1))
    residuals = [policy.residual(policy.sessions["u"], 1 + e) for e in (60, 600, 3000, 6000, 7000, 20000)]
    assert all(r > 0 for r in residuals), residuals
    for step in range(4 * 3600):  # flush four times a second for an hour, after two hours idle
        policy.flush(sink, now=7201 + step * 0.25)
    assert len(sink.hints) <= 5 and any(h.HasField("release") for h in sink.hints), sink.hints
    assert policy.sessions["u"].let_go


def test_a_hung_tool_call_is_not_re_sent_a_hint_at_every_flush() -> None:
    """The tool usually returns in 20 to 60 s; this run hangs for 30 minutes."""
    policy, sink = SessionPolicy(clock=lambda: 0.0), RecordingSink()
    t = 0.0
    for i in range(5):
        policy.observe(ToolCallStarted("a1", tools=("run_tests",), t=t))
        t += 20 + 10 * i
        policy.observe(RequestSent("a1", t=t))
        t += 1
    policy.observe(ToolCallStarted("a2", tools=("run_tests",), t=t))
    for step in range(4 * 1800):
        policy.flush(sink, now=t + step * 0.25)
    hung = [h for h in sink.hints if h.selector.session.session_id == "a2"]
    assert len(hung) <= 30, f"{len(hung)} hints in 30 minutes"


def test_a_session_that_came_back_cold_is_kept_again_in_its_next_pause() -> None:
    """A Retain answered MISSING (the blocks were evicted while paused) marks the session cold;
    its next request stores the blocks again, so the pause after it is kept and refreshed."""
    policy, sink = SessionPolicy(clock=lambda: 0.0), RecordingSink()
    policy.observe(RequestSent("s", t=0))
    policy.observe(ToolCallStarted("s", tools=("build",), t=1))
    (keep,) = policy.drain(now=1)
    policy.observe(RequestSent("s", t=100))
    # The answer arrives once the request is on its way: MISSING, the blocks were evicted.
    policy.record([keep], [pb.HintResult(hint_id=keep.hint_id, outcome=pb.OUTCOME_MISSING, reason=pb.REASON_NOT_RESIDENT)])
    assert policy.sessions["s"].cold
    policy.observe(ToolCallStarted("s", tools=("build",), t=101))
    assert not policy.sessions["s"].cold
    before = len(sink.hints)
    for t in range(101, 1200, 5):
        policy.flush(sink, now=float(t))
    assert len([h for h in sink.hints[before:] if h.WhichOneof("action") in ("retain", "pin")]) >= 2, "kept and refreshed"


def test_a_template_stays_protected_when_the_engine_caps_its_ttl() -> None:
    """Template Retains ask for template_ttl_s (600 s) within the engine's max_ttl; with a 120 s
    max_ttl the refresh came every 300 s, leaving the template unprotected 180 s of every 300."""
    caps = pb.GetCapabilitiesResponse(limits=pb.Limits(max_ttl={"seconds": 120}))
    policy, sink = SessionPolicy(clock=lambda: 0.0), RecordingSink()
    policy.configure(caps)
    policy.observe(TemplateDeclared("sys", continuation("sys-v3"), t=0))
    protected_until = 0.0
    for t in range(0, 1801, 10):
        n = len(sink.hints)
        policy.flush(sink, now=float(t))
        for hint in sink.hints[n:]:
            assert hint.retain.ttl.seconds <= 120
            protected_until = t + hint.retain.ttl.seconds
        assert protected_until > t, f"unprotected at t={t}"
