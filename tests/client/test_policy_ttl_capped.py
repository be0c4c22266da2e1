"""SessionPolicy against an engine that caps TTLs it was not told about (no GetCapabilities).

The engine answers CLIPPED/TTL_CAPPED with the TTL it granted (`effective_ttl`). The policy
lowered its TTLs for later hints, but kept counting the capped hint's protection at the TTL it
asked for: a session paused longer than the cap was unprotected from the cap's end to its next
refresh, and a template (refreshed at half the TTL asked for) from the cap's end to that refresh.
"""

from __future__ import annotations

from kvhint.v1 import kvhint_pb2 as pb
from kvhint_client import continuation
from kvhint_client.policy import PolicyConfig, RequestSent, TemplateDeclared, ToolCallStarted

from test_policy import make, train
from test_policy_template_targets import GrantingEngine


def grant_until(engine: GrantingEngine, selector: pb.Selector) -> float:
    return engine.grants.get(selector.SerializeToString(deterministic=True), float("-inf"))


def test_a_session_paused_past_a_capped_ttl_stays_protected_until_it_resumes() -> None:
    policy, trainer = make()
    t0 = train(policy, trainer, "build", [100.0] * 5, "trainer", 0.0)  # 'build' pauses last 100 s
    engine = GrantingEngine(max_ttl_s=60.0)  # the Retain asks 400 s, the engine grants 60 s
    policy.observe(ToolCallStarted("a", tools=("build",), t=t0))
    a = pb.Selector(session=pb.SessionSelector(session_id="a"))
    for k in range(400):  # flushing four times a second until it resumes
        t = t0 + k * 0.25
        engine.flush(policy, t)
        assert grant_until(engine, a) > t, f"unprotected {t - t0:g} s into the pause"
    policy.observe(RequestSent("a", t=t0 + 100.0))
    capped = [h for h in engine.hints if h.selector == a and h.retain.ttl.seconds > 60]
    assert len(capped) == 1, "after the first cap, no TTL asks for more than the engine grants"


def test_a_template_under_a_capped_ttl_is_refreshed_within_the_granted_ttl() -> None:
    policy, _ = make(PolicyConfig(template_ttl_s=600))
    engine = GrantingEngine(max_ttl_s=120.0)
    policy.observe(TemplateDeclared("sys", continuation("sys-v1"), t=0.0))
    sys = continuation("sys-v1").selector
    for t in range(0, 1801, 5):
        engine.flush(policy, float(t))
        assert grant_until(engine, sys) > t, f"template unprotected at t={t}"
    refreshes = [h for h in engine.hints if h.selector == sys]
    assert 1801 / 60 - 2 <= len(refreshes) <= 1801 / 60 + 2, "refreshed at half the granted TTL, not more often"
