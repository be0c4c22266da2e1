"""SessionPolicy templates declared again: what the engine holds follows the declarations.

`GrantingEngine` answers hints as a served engine does for what these tests read: a Retain or
Pin holds its selector until its TTL (capped at `max_ttl_s`, then CLIPPED/TTL_CAPPED with the
granted TTL), a Release drops its selector's grant. A template id declared again with a new
target used to leave the old target's grant in place until its TTL ran out (600 s by default),
above every session, for content the router no longer uses.
"""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from kvhint.v1 import kvhint_pb2 as pb
from kvhint_client import continuation
from kvhint_client.durations import duration_to_seconds, to_duration
from kvhint_client.policy import PolicyConfig, RecordingSink, SessionPolicy, TemplateDeclared, TemplateRetired


class GrantingEngine(RecordingSink):
    """A sink that keeps each selector's grant: {selector bytes: expiry}, at `now`."""

    def __init__(self, max_ttl_s: float = math.inf) -> None:
        super().__init__(self._apply)
        self.max_ttl_s = max_ttl_s
        self.now = 0.0
        self.grants: dict[bytes, float] = {}

    def _apply(self, hint: pb.Hint) -> pb.HintResult:
        key = hint.selector.SerializeToString(deterministic=True)
        action = hint.WhichOneof("action")
        if action == "release":
            self.grants.pop(key, None)
            return pb.HintResult(hint_id=hint.hint_id, outcome=pb.OUTCOME_ACCEPTED)
        if action not in ("retain", "pin"):
            return pb.HintResult(hint_id=hint.hint_id, outcome=pb.OUTCOME_ACCEPTED)
        asked = getattr(hint, action).ttl
        granted = min(duration_to_seconds(asked), self.max_ttl_s)
        self.grants[key] = self.now + granted
        result = pb.HintResult(hint_id=hint.hint_id, outcome=pb.OUTCOME_ACCEPTED, effective_ttl=to_duration(granted))
        if granted < duration_to_seconds(asked):
            result.outcome, result.reason = pb.OUTCOME_CLIPPED, pb.REASON_TTL_CAPPED
            result.clips.add(reason=pb.REASON_TTL_CAPPED, requested_ttl=asked, granted_ttl=to_duration(granted))
        return result

    def flush(self, policy: SessionPolicy, now: float) -> None:
        self.now = now
        policy.flush(self, now)

    def held(self) -> set[str]:
        """Continuation ids whose grant is in effect now."""
        out = set()
        for key, until in self.grants.items():
            selector = pb.Selector.FromString(key)
            if until > self.now and selector.HasField("continuation"):
                out.add(selector.continuation.continuation_id)
        return out


def template_actions(engine: RecordingSink) -> list[tuple[str, str]]:
    return [(h.WhichOneof("action"), h.selector.continuation.continuation_id) for h in engine.hints]


def test_a_template_declared_again_with_a_new_target_releases_the_old_one() -> None:
    policy, engine = SessionPolicy(clock=lambda: 0.0), GrantingEngine()
    policy.observe(TemplateDeclared("sys", continuation("sys-v1"), t=0.0))
    engine.flush(policy, 0.0)
    policy.observe(TemplateDeclared("sys", continuation("sys-v2"), t=10.0))  # the prompt changed
    engine.flush(policy, 10.0)
    assert template_actions(engine) == [("retain", "sys-v1"), ("release", "sys-v1"), ("retain", "sys-v2")]
    assert engine.held() == {"sys-v2"}
    for t in range(11, 1300, 7):  # refreshes keep the new target only
        engine.flush(policy, float(t))
        assert engine.held() == {"sys-v2"}, f"at t={t}"


def test_a_template_declared_again_with_the_same_target_is_a_refresh() -> None:
    policy, engine = SessionPolicy(PolicyConfig(template_ttl_s=100), clock=lambda: 0.0), GrantingEngine()
    policy.observe(TemplateDeclared("sys", continuation("sys-v1"), t=0.0))
    engine.flush(policy, 0.0)
    policy.observe(TemplateDeclared("sys", continuation("sys-v1"), t=40.0))
    engine.flush(policy, 40.0)
    assert template_actions(engine) == [("retain", "sys-v1"), ("retain", "sys-v1")]
    engine.flush(policy, 89.0)  # the refresh counts from the declaration again: half the TTL after 40 s
    assert len(engine.hints) == 2
    engine.flush(policy, 90.0)
    assert template_actions(engine)[-1] == ("retain", "sys-v1") and engine.held() == {"sys-v1"}


def test_retiring_one_of_two_templates_on_one_target_keeps_that_target() -> None:
    """Two template ids declared on one continuation share its grant on the engine (one owner):
    retiring one, or declaring it again elsewhere, must not release what the other still uses."""
    policy, engine = SessionPolicy(clock=lambda: 0.0), GrantingEngine()
    policy.observe(TemplateDeclared("tools", continuation("shared"), t=0.0))
    policy.observe(TemplateDeclared("sys", continuation("shared"), t=0.0))
    engine.flush(policy, 0.0)
    policy.observe(TemplateRetired("sys", t=1.0))
    engine.flush(policy, 1.0)
    assert engine.held() == {"shared"}
    policy.observe(TemplateDeclared("sys", continuation("shared"), t=2.0))
    policy.observe(TemplateDeclared("sys", continuation("sys-v2"), t=2.0))
    engine.flush(policy, 2.0)
    assert engine.held() == {"shared", "sys-v2"}
    policy.observe(TemplateRetired("tools", t=3.0))
    engine.flush(policy, 3.0)
    assert engine.held() == {"sys-v2"}


declare = st.tuples(st.just("declare"), st.sampled_from(["a", "b"]), st.sampled_from(["c1", "c2", "c3"]))
retire = st.tuples(st.just("retire"), st.sampled_from(["a", "b"]), st.just(""))
step = st.tuples(st.lists(st.one_of(declare, retire), min_size=1, max_size=4), st.floats(0.1, 400.0))


@settings(max_examples=200, deadline=None)
@given(st.lists(step, min_size=1, max_size=12))
def test_the_engine_holds_exactly_the_targets_declared(steps: list) -> None:
    """Whatever the declarations, re-declarations and retirements between two flushes, after the
    flush the engine holds a grant on every target some template declares and on no other."""
    policy, engine = SessionPolicy(clock=lambda: 0.0), GrantingEngine()
    declared: dict[str, str] = {}
    t = 0.0
    for signals, dt in steps:
        for kind, template_id, target in signals:
            if kind == "declare":
                policy.observe(TemplateDeclared(template_id, continuation(target), t=t))
                declared[template_id] = target
            else:
                policy.observe(TemplateRetired(template_id, t=t))
                declared.pop(template_id, None)
        engine.flush(policy, t)
        assert engine.held() == set(declared.values()), (t, template_actions(engine))
        t += dt
