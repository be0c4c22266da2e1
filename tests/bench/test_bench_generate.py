"""Trace generator: determinism, structure, scale and headroom of the presets."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from bench.generate import PRESETS, TraceParams, generate_trace, make_heldout
from bench.simulate import analyze, compile_trace, peak_live_blocks
from bench.trace import ChildSpawned, Out, Request, SessionEnded, ToolCallStarted, Trace


@pytest.fixture(scope="module")
def fast_trace() -> Trace:
    return generate_trace(PRESETS["fast"], 0, preset="fast")


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_deterministic_from_seed(preset):
    a = generate_trace(PRESETS[preset], 7, preset=preset).dumps()
    b = generate_trace(PRESETS[preset], 7, preset=preset).dumps()
    assert a == b
    c = generate_trace(PRESETS[preset], 8, preset=preset).dumps()
    assert a != c


def test_roundtrip_preserves_analysis(fast_trace):
    back = Trace.loads(fast_trace.dumps())
    a, b = analyze(fast_trace), analyze(back)
    for k in a.results:
        assert a.results[k].cached_tokens == b.results[k].cached_tokens


def test_structure(fast_trace):
    tr = fast_trace
    tr.validate()
    h = tr.header
    p = PRESETS["fast"]
    reqs = tr.requests()
    by_id = tr.request_index()
    # token ids in range, prompt + max_tokens within the model length
    for r in reqs:
        ids = np.asarray(tr.expand_prompt(r))
        assert ids.min() >= 3 and ids.max() < 4096
        assert r.num_prompt_tokens + r.max_tokens <= min(h.max_model_len, p.max_context_tokens)
        assert p.output_tokens[0] <= r.max_tokens <= p.output_tokens[1]
    # every session ends exactly once, after its last request
    ended = [s for s in tr.signals() if isinstance(s, SessionEnded)]
    assert len({e.session_id for e in ended}) == len(ended) == len({r.session_id for r in reqs})
    last_req = {}
    for r in reqs:
        last_req[r.session_id] = r
    for e in ended:
        assert e.t >= last_req[e.session_id].t
    top = {r.session_id for r in reqs if r.parent_session_id is None}
    assert len(top) == p.num_sessions
    # context grows: each turn's prompt extends the previous prompt + its output
    prev = {}
    for r in reqs:
        if r.session_id in prev and r.cause in ("short", "long", "children"):
            q = prev[r.session_id]
            assert r.prompt[: len(q.prompt)] == q.prompt
            assert r.prompt[len(q.prompt)] == Out(q.request_id, q.max_tokens)
        prev[r.session_id] = r
    # children start from their parent's full context, after child_spawned
    spawned = {s.child_session_id: s for s in tr.signals() if isinstance(s, ChildSpawned)}
    assert spawned, "fast preset should fan out at least once"
    for r in reqs:
        if r.parent_session_id is not None and r.turn == 0:
            sig = spawned[r.session_id]
            assert sig.parent_session_id == r.parent_session_id and sig.t <= r.t
            parent_req = by_id[r.after]
            assert r.prompt[: len(parent_req.prompt)] == parent_req.prompt
    # a tool call signal precedes every tool-caused request of that session
    tools = [s for s in tr.signals() if isinstance(s, ToolCallStarted)]
    assert len(tools) == sum(1 for r in reqs if r.cause in ("short", "long"))
    # all requests issued in time order; concurrency respected for top-level sessions
    live, peak = set(), 0
    for e in tr.events:
        if isinstance(e, Request) and e.parent_session_id is None:
            live.add(e.session_id)
        elif isinstance(e, SessionEnded):
            live.discard(e.session_id)
        peak = max(peak, len(live))
    assert peak <= p.concurrency


def test_mispredictions_and_pause_mix():
    p = replace(PRESETS["default"], num_sessions=40, mispredict_prob=0.3, p_long=0.5, fanout_prob=0.0)
    tr = generate_trace(p, 3)
    expected = {}
    for s in tr.signals():
        if isinstance(s, ToolCallStarted):
            expected[s.tool_call_id] = s.expected_duration_class
    reqs = [r for r in tr.requests() if r.cause in ("short", "long")]
    wrong = 0
    for r in reqs:
        wrong += expected[f"{r.session_id}/{r.turn}"] != r.cause
        lo, hi = p.short_pause_s if r.cause == "short" else p.long_pause_s
        assert lo - 1e-3 <= r.delay_s <= hi + 1e-3
    rate = wrong / len(reqs)
    assert 0.2 < rate < 0.4
    long_frac = sum(r.cause == "long" for r in reqs) / len(reqs)
    assert 0.4 < long_frac < 0.6


def test_pool_sized_from_live_set(fast_trace):
    h = fast_trace.header
    peak = peak_live_blocks(compile_trace(fast_trace))
    assert h.stats["peak_live_blocks"] == peak
    usable = h.num_gpu_blocks - 1
    assert usable >= h.max_model_len // h.block_size
    assert usable < peak  # a cache smaller than the live working set


@pytest.mark.parametrize(
    "make",
    [
        lambda: generate_trace(PRESETS["default"], 0, preset="default"),
        lambda: make_heldout(1001),
    ],
    ids=["default-seed0", "heldout-seed1001"],
)
def test_presets_have_headroom(make):
    """A trace only discriminates between policies with headroom: Belady must
    recompute <= 0.85x of what LRU recomputes (issue 7)."""
    tr = make()
    a = analyze(tr)
    r = a.results
    assert a.belady_over_lru <= 0.85
    assert r["infinite"].recomputed_tokens <= r["belady"].recomputed_tokens <= r["lru"].recomputed_tokens
    assert tr.header.num_gpu_blocks - 1 < a.peak_live_blocks


def test_params_json_roundtrip():
    p = PRESETS["heldout"]
    assert TraceParams.from_json(p.to_json()) == p


def test_bad_params_rejected():
    with pytest.raises(ValueError):
        generate_trace(replace(PRESETS["fast"], turns=(3, 1)), 0)
    with pytest.raises(ValueError):
        generate_trace(replace(PRESETS["fast"], max_context_tokens=100), 0)


def test_users_who_leave_drop_only_their_end_signal(fast_trace):
    """abandon_prob: a top-level session's session_ended is left out (its user left and the
    runtime never said so); the traffic is otherwise the same, children still end, and 0 gives
    the trace of the earlier generator (its header too)."""
    leave = generate_trace(replace(PRESETS["fast"], abandon_prob=1.0), 0, preset="fast")
    assert [e for e in leave.events if not isinstance(e, SessionEnded)] == [
        e for e in fast_trace.events if not isinstance(e, SessionEnded)
    ]
    ended = {e.session_id for e in leave.events if isinstance(e, SessionEnded)}
    children = {e.child_session_id for e in fast_trace.events if isinstance(e, ChildSpawned)}
    assert children and ended == children
    assert "abandon_prob" not in fast_trace.header.params
    with pytest.raises(ValueError, match="abandon_prob"):
        replace(PRESETS["fast"], abandon_prob=1.5).validate()
