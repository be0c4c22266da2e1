"""Reference hint policy: causal (no future knowledge), rule-by-rule behaviour."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.generate import PRESETS, generate_trace
from bench.policy import (
    Demote,
    Pin,
    PolicyConfig,
    Prefetch,
    ReferencePolicy,
    Release,
    Retain,
    Target,
    TimedAction,
    action_to_json,
    run_policy,
    shared_prefix_target,
)
from bench.trace import ChildSpawned, SessionEnded, ToolCallStarted


@st.composite
def signal_streams(draw, min_size=0, max_size=30):
    n = draw(st.integers(min_size, max_size))
    t = 0.0
    out = []
    sessions = [f"s{i}" for i in range(4)]
    for i in range(n):
        t += draw(st.sampled_from([0.0, 0.1, 1.0, 7.5, 400.0]))
        k = draw(st.integers(0, 2))
        s = draw(st.sampled_from(sessions))
        if k == 0:
            out.append(ToolCallStarted(t, s, draw(st.sampled_from(["short", "long"])), f"{s}/{i}"))
        elif k == 1:
            out.append(SessionEnded(t, s))
        else:
            out.append(ChildSpawned(t, s, f"{s}.c{i}"))
    return out


PREFIX = Target("prefix", "cp", 512)


@settings(max_examples=200, deadline=None)
@given(signal_streams(min_size=1), signal_streams(), st.data())
def test_output_up_to_t_ignores_later_signals(stream, other, data):
    """Altering or appending signals after time T never changes the actions
    emitted up to T (the policy cannot look ahead)."""
    cfg = PolicyConfig(short_class_s=1.5, long_class_s=30.0)
    cut = data.draw(st.integers(0, len(stream)))
    prefix = stream[:cut]
    t_cut = prefix[-1].t if prefix else 0.0
    # a different future: shift the other stream after the cut
    future = [type(s)(**{**s.__dict__, "t": s.t + t_cut}) for s in other]
    a = run_policy(stream, cfg, PREFIX)
    b = run_policy(prefix + future, cfg, PREFIX)
    n_prefix = len(run_policy(prefix, cfg, PREFIX))
    assert a[:n_prefix] == b[:n_prefix]
    assert all(x.t <= t_cut for x in a[:n_prefix])


def test_incremental_equals_batch():
    tr = generate_trace(PRESETS["fast"], 0)
    cfg = PolicyConfig.from_header(tr.header)
    sp = shared_prefix_target(tr.header)
    batch = run_policy(tr.signals(), cfg, sp)
    pol = ReferencePolicy(cfg, sp)
    inc = [TimedAction(0.0, a) for a in pol.start(0.0)]
    for s in tr.signals():
        inc.extend(TimedAction(s.t, a) for a in pol.observe(s))
    assert inc == batch


def test_rules():
    cfg = PolicyConfig(short_class_s=2.0, long_class_s=40.0)
    pol = ReferencePolicy(cfg, PREFIX)
    assert pol.start(0.0) == [Retain(PREFIX, cfg.prefix_priority, cfg.prefix_ttl_s)]
    assert pol.observe(ToolCallStarted(1.0, "a", "short")) == [
        Pin(Target.session("a"), 4.0),
        Retain(Target.session("a"), cfg.short_priority, 60.0),
    ]
    assert pol.observe(ToolCallStarted(2.0, "b", "long")) == [Retain(Target.session("b"), cfg.long_priority, 60.0)]
    assert pol.observe(ChildSpawned(3.0, "c", "c.0")) == [Retain(Target.session("c"), cfg.parent_priority, 60.0)]
    assert pol.observe(ChildSpawned(3.0, "c", "c.1")) == []  # one Retain per parent wait
    assert pol.observe(SessionEnded(4.0, "a")) == [Release(Target.session("a"))]
    # prefix keep-alive after half its TTL
    acts = pol.observe(SessionEnded(cfg.prefix_ttl_s / 2 + 1, "b"))
    assert acts[0] == Retain(PREFIX, cfg.prefix_priority, cfg.prefix_ttl_s)
    with pytest.raises(ValueError):
        pol.observe(SessionEnded(1.0, "x"))  # time went backwards


def test_priorities_are_ordered_and_no_release_variant():
    cfg = PolicyConfig()
    assert cfg.long_priority < cfg.short_priority < cfg.parent_priority < cfg.prefix_priority
    pol = ReferencePolicy(PolicyConfig(release_on_end=False, retain_shared_prefix=False))
    assert pol.start(0.0) == []
    assert pol.observe(SessionEnded(1.0, "a")) == []


def test_tiers_variant_demotes_long_pauses_and_prefetches_on_a_class_timer():
    from bench.policy import policy_variant

    cfg = policy_variant("hints+tiers", PolicyConfig(short_class_s=2.0, long_class_s=40.0))
    pol = ReferencePolicy(cfg)
    b = Target.session("b")
    # a long pause: Demote now, Prefetch on a timer derived from the declared class only
    assert pol.observe(ToolCallStarted(1.0, "b", "long")) == [Demote(b), Prefetch(b, cfg.prefetch_after_factor * 40.0)]
    # a short pause is still pinned and retained; the end is still a Release
    assert pol.observe(ToolCallStarted(2.0, "a", "short"))[0] == Pin(Target.session("a"), 4.0)
    assert pol.observe(SessionEnded(3.0, "b")) == [Release(b)]
    assert action_to_json(Prefetch(b, 8.0)) == {"action": "prefetch", "target": {"kind": "session", "id": "b"},
                                                "delay_s": 8.0}
    # without tiers the long pause is a Retain, as before
    plain = ReferencePolicy(policy_variant("hints+release", PolicyConfig(long_class_s=40.0)))
    assert plain.observe(ToolCallStarted(1.0, "b", "long")) == [Retain(b, plain.config.long_priority, 60.0)]


def test_config_from_header_uses_declared_classes():
    tr = generate_trace(PRESETS["heldout"], 5)
    cfg = PolicyConfig.from_header(tr.header)
    assert cfg.short_class_s == PRESETS["heldout"].short_pause_s[1]
    assert cfg.long_class_s == PRESETS["heldout"].long_pause_s[1]


def test_action_json_is_translatable():
    j = action_to_json(Retain(PREFIX, 100, 600.0))
    assert j == {"action": "retain", "target": {"kind": "prefix", "id": "cp", "num_tokens": 512}, "ttl_s": 600.0,
                 "priority": 100}
    assert action_to_json(Pin(Target.session("s1"), 4.0)) == {
        "action": "pin", "target": {"kind": "session", "id": "s1"}, "ttl_s": 4.0}
    assert action_to_json(Release(Target.session("s1"))) == {"action": "release", "target": {"kind": "session", "id": "s1"}}


def test_policy_reads_only_signals():
    """The hinted simulation feeds the policy signals only: stripping every
    request's ground-truth fields (after/delay/cause/t_done) leaves the
    policy's actions unchanged."""
    from dataclasses import replace

    from bench.trace import Request, Trace

    tr = generate_trace(PRESETS["fast"], 1)
    stripped = Trace(
        tr.header,
        [replace(e, after=None, delay_s=None, cause=None) if isinstance(e, Request) else e for e in tr.events],
    )
    cfg = PolicyConfig.from_header(tr.header)
    sp = shared_prefix_target(tr.header)
    assert run_policy(tr.signals(), cfg, sp) == run_policy(stripped.signals(), cfg, sp)
