"""kvhint_client.policy warm start: a PauseModel's learned state exported as JSON and loaded
into a new model (or a new SessionPolicy) predicts exactly what the original predicts, now and
after further observations; malformed states are refused whole."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhint_client.policy import (
    PAUSE_STATE_FORMAT,
    PAUSE_STATE_VERSION,
    LogNormalPrior,
    PauseModel,
    PolicyConfig,
    RecordingSink,
    RequestSent,
    SessionPolicy,
    ToolCallStarted,
)
from kvhint_client.policy.estimator import DEFAULT_MAX_KEYS

KEYS = [("tool", "a", "c1"), ("tool", "a"), ("tool", "b"), ("declared", "long"), ("class", "c1"), ("all",)]
HIERARCHIES = [tuple(KEYS[i:]) for i in range(len(KEYS))] + [(("tool", "b"), ("all",)), (("unseen",), ("all",))]

observations = st.lists(
    st.tuples(
        st.sets(st.sampled_from(KEYS), min_size=1),
        st.one_of(st.floats(0, 500, allow_nan=False), st.just(math.inf)),  # inf: the pause ended its session
    ),
    max_size=60,
)


def _add(model: PauseModel, keys: set[tuple[str, ...]], x: float) -> None:
    if math.isinf(x):
        model.observe_end(sorted(keys))
    else:
        model.observe(sorted(keys), x)


def _predictions(model: PauseModel, elapsed: float, prior: LogNormalPrior | None) -> list[Any]:
    out: list[Any] = []
    for keys in HIERARCHIES:
        out += [model.quantile(keys, 0.7, prior), model.residual(keys, elapsed, prior, 0.7), model.reuse_index(keys, elapsed, prior)]
    return out


@settings(max_examples=60, deadline=None)
@given(
    observations,
    observations,
    st.floats(0, 300),
    st.sampled_from([None, LogNormalPrior(20.0, 0.5)]),
    st.sampled_from([4, 256]),
    st.sampled_from([3, DEFAULT_MAX_KEYS]),
)
def test_export_then_load_predicts_identically(
    before: list[tuple[set[tuple[str, ...]], float]],
    after: list[tuple[set[tuple[str, ...]], float]],
    elapsed: float,
    prior: LogNormalPrior | None,
    window: int,
    max_keys: int,
) -> None:
    """Also with fewer keys allowed than the observations use: the loaded model keeps the same
    keys and drops the same ones next."""
    original = PauseModel(window=window, min_samples=2, max_keys=max_keys)
    for keys, x in before:
        _add(original, keys, x)
    state = json.loads(json.dumps(original.export()))  # through JSON, as a router would store it
    loaded = PauseModel(window=window, min_samples=2, max_keys=max_keys)
    loaded.load(state)
    assert loaded.export() == original.export()
    assert _predictions(loaded, elapsed, prior) == _predictions(original, elapsed, prior)
    for keys, x in after:  # the sliding windows continue from the same order
        _add(original, keys, x)
        _add(loaded, keys, x)
    assert _predictions(loaded, elapsed, prior) == _predictions(original, elapsed, prior)


def test_a_smaller_window_keeps_the_most_recent_samples() -> None:
    big = PauseModel(window=10)
    for x in range(10):
        big.observe([("all",)], float(x))
    small = PauseModel(window=3)
    small.load(big.export())
    assert small.export()["keys"] == [{"key": ["all"], "samples": [7.0, 8.0, 9.0]}]


def test_keys_from_traffic_are_bounded_dropping_the_least_recently_observed() -> None:
    """Session classes and tool names come from clients and models: a router seeing a new one per
    session used to keep (and export) every one of them, about 1 KB each, forever."""
    model = PauseModel(max_keys=3)
    for name in ("a", "b", "c"):
        model.observe([("tool", name)], 1.0)
    model.observe([("tool", "a")], 2.0)  # a is now the most recently observed
    model.observe([("tool", "d")], 3.0)  # drops b, the least recently observed
    state = model.export()
    assert [entry["key"] for entry in state["keys"]] == [["tool", "c"], ["tool", "a"], ["tool", "d"]]
    assert model.count(("tool", "a")) == 2 and model.count(("tool", "b")) == 0
    smaller = PauseModel(max_keys=2)
    smaller.load(state)  # keeps the most recently observed keys
    assert [entry["key"] for entry in smaller.export()["keys"]] == [["tool", "a"], ["tool", "d"]]
    with pytest.raises(ValueError, match="max_keys must be an integer >= 1, got 0"):
        PauseModel(max_keys=0)


def test_a_policy_seeing_a_new_class_and_tool_per_session_keeps_a_bounded_model() -> None:
    policy, sink = SessionPolicy(clock=lambda: 0.0), RecordingSink()
    assert policy.model.max_keys == DEFAULT_MAX_KEYS == 4096
    t = 0.0
    for i in range(DEFAULT_MAX_KEYS):  # each session: its own class and tool, one pause
        sid = f"s{i}"
        policy.observe(RequestSent(sid, t=t, session_class=f"cls-{i}"))
        policy.observe(ToolCallStarted(sid, tools=(f"tool-{i}",), t=t + 1))
        policy.observe(RequestSent(sid, t=t + 2))
        t += 3
    policy.flush(sink, now=t)
    keys = policy.model.export()["keys"]
    assert len(keys) == DEFAULT_MAX_KEYS
    assert ["all"] in [entry["key"] for entry in keys], "the keys every pause updates are kept"


def test_pauses_that_ended_their_session_travel_as_null_and_version_1_states_still_load() -> None:
    model = PauseModel()
    model.observe([("idle",)], 2.0)
    model.observe_end([("idle",)])
    state = model.export()
    assert state["version"] == 2 and state["keys"] == [{"key": ["idle"], "samples": [2.0, None]}]
    old = {"format": PAUSE_STATE_FORMAT, "version": 1, "keys": [{"key": ["all"], "samples": [1.0, 2.0]}]}
    model.load(old)  # an export of the earlier version: no null samples
    assert model.export()["keys"] == [{"key": ["all"], "samples": [1.0, 2.0]}]
    with pytest.raises(ValueError, match="finite number >= 0, got None"):
        model.load({**old, "keys": [{"key": ["all"], "samples": [1.0, None]}]})  # null is version 2's


def test_a_warm_policy_predicts_from_what_the_earlier_one_learned() -> None:
    """SessionPolicy(pause_state=...): the first pause of a tool is predicted from the earlier
    policy's gaps for it, where a cold policy uses the prior."""
    earlier = SessionPolicy(PolicyConfig(), clock=lambda: 0.0, id_prefix="e")
    sink = RecordingSink()
    t = 0.0
    for _ in range(20):
        earlier.observe(ToolCallStarted("s", tools=("build",), t=t))
        earlier.flush(sink, t)
        t += 40.0
        earlier.observe(RequestSent("s", t=t))
    state = json.loads(json.dumps(earlier.model.export()))
    warm = SessionPolicy(PolicyConfig(), clock=lambda: 0.0, pause_state=state, id_prefix="w")
    cold = SessionPolicy(PolicyConfig(), clock=lambda: 0.0, id_prefix="c")
    for policy in (warm, cold):
        policy.observe(ToolCallStarted("new", tools=("build",), t=0.0))
    assert warm.predicted_resume("new", 0.0) == pytest.approx(40.0, rel=0.2)
    assert cold.predicted_resume("new", 0.0) < 20.0  # the prior's median is 5 s


def _valid() -> dict[str, Any]:
    return {"format": PAUSE_STATE_FORMAT, "version": PAUSE_STATE_VERSION,
            "keys": [{"key": ["all"], "samples": [1.0, 2.0]}, {"key": ["tool", "x"], "samples": [3.0]}]}


def _with(path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    state = _valid()
    node: Any = state
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = value
    return state


BAD = [
    ("not a mapping", [1, 2], "must be a mapping"),
    ("other format", _with(("format",), "something.else"), "format"),
    ("newer version", _with(("version",), PAUSE_STATE_VERSION + 1), "version"),
    ("version as a string", _with(("version",), str(PAUSE_STATE_VERSION)), "version"),
    ("keys not a list", _with(("keys",), {"all": [1.0]}), "'keys' must be a list"),
    ("entry not a mapping", _with(("keys", 1), ["tool", "x"]), "exactly 'key' and 'samples'"),
    ("extra field", _with(("keys", 1, "weight"), 2), "exactly 'key' and 'samples'"),
    ("key not a list", _with(("keys", 1, "key"), "tool"), "non-empty list of strings"),
    ("empty key", _with(("keys", 1, "key"), []), "non-empty list of strings"),
    ("key of numbers", _with(("keys", 1, "key"), ["tool", 3]), "non-empty list of strings"),
    ("duplicate key", _with(("keys", 1, "key"), ["all"]), "more than once"),
    ("no samples", _with(("keys", 1, "samples"), []), "non-empty list"),
    ("samples not a list", _with(("keys", 1, "samples"), 3.0), "non-empty list"),
    ("negative sample", _with(("keys", 1, "samples"), [1.0, -0.5]), "finite number >= 0"),
    ("NaN sample", _with(("keys", 1, "samples"), [math.nan]), "finite number >= 0"),
    ("infinite sample", _with(("keys", 1, "samples"), [math.inf]), "finite number >= 0"),
    ("string sample", _with(("keys", 1, "samples"), ["3.0"]), "finite number >= 0"),
    ("boolean sample", _with(("keys", 1, "samples"), [True]), "finite number >= 0"),
    # A JSON integer past float's range (json.loads gives an int): OverflowError escaped load.
    ("integer sample past float's range", _with(("keys", 1, "samples"), [1.0, 10**400]), "finite number >= 0"),
]


@pytest.mark.parametrize(("state", "message"), [(s, m) for _, s, m in BAD], ids=[name for name, _, _ in BAD])
def test_malformed_state_is_refused_and_nothing_is_loaded(state: Any, message: str) -> None:
    model = PauseModel()
    for x in (30.0, 31.0, 32.0):
        model.observe([("all",), ("tool", "y")], x)
    before = model.export()
    with pytest.raises(ValueError, match=message):
        model.load(state)
    assert model.export() == before  # the first, valid entry was not loaded either
    with pytest.raises(ValueError, match=message):
        SessionPolicy(PolicyConfig(), pause_state=state)


def test_valid_fixture_loads() -> None:
    """The rejection cases above differ from a state that loads in one field each."""
    model = PauseModel()
    model.load(_valid())
    assert model.count(("all",)) == 2 and model.count(("tool", "x")) == 1


def test_model_and_pause_state_together_are_refused() -> None:
    with pytest.raises(ValueError, match="not both"):
        SessionPolicy(PolicyConfig(), model=PauseModel(), pause_state=PauseModel().export())
