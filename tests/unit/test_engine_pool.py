"""tests/engine_pool.py, the pool the engine fixtures take their engines from, with fake engines:
what is started ahead, when, and that everything started is stopped once."""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from engine_pool import EnginePool, uses
from hypothesis import given, settings
from hypothesis import strategies as st
from shared_engines import STARTS_ENV, side_by_side


@dataclass
class Fakes:
    """start/stop callables per name that record what happened."""

    started: list[str] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    serial: int = 0

    def start(self, name: str, gate: threading.Barrier | None = None, fail: bool = False) -> Any:
        def go() -> Any:
            with self.lock:
                self.started.append(name)
                self.serial += 1
                engine = (name, self.serial)
            if gate is not None:
                gate.wait(timeout=5)
            if fail:
                raise RuntimeError(f"{name} did not start")
            return engine

        return go

    def stop(self, engine: Any) -> None:
        with self.lock:
            self.stopped.append(engine)


def item(*fixtures: str, **params: object) -> Any:
    return SimpleNamespace(fixturenames=list(fixtures), callspec=SimpleNamespace(params=params) if params else None)


def test_taking_an_engine_starts_the_next_one_the_plan_needs_beside_it() -> None:
    fakes, pool = Fakes(), EnginePool(2)
    both = threading.Barrier(2)  # each start waits for the other: only starts side by side get through
    pool.register("a", fakes.start("a", both), fakes.stop, uses("fa"))
    pool.register("b", fakes.start("b", both), fakes.stop, uses("fb"))
    pool.register("c", fakes.start("c"), fakes.stop, uses("fc"))
    assert pool.plan([item("fa"), item("fc"), item("fb")]) == ["a", "c", "b"]
    pool.plan([item("fa"), item("fb"), item("fc")])
    a = pool.take("a")
    assert a[0] == "a" and sorted(pool.started()) == ["a", "b"]
    b = pool.take("b")  # already running: nothing more starts
    assert b[0] == "b" and sorted(fakes.started) == ["a", "b"]
    pool.give_back("a", a)
    pool.give_back("b", b)
    assert pool.close() == []
    assert sorted(fakes.stopped) == sorted([a, b]) and "c" not in fakes.started


def test_engines_no_selected_test_needs_are_never_started_ahead() -> None:
    fakes, pool = Fakes(), EnginePool(2)
    pool.register("a", fakes.start("a"), fakes.stop, uses("fa"))
    pool.register("unused", fakes.start("unused"), fakes.stop, uses("nobody"))
    pool.plan([item("fa")])
    pool.give_back("a", pool.take("a"))
    assert pool.close() == []
    assert fakes.started == ["a"]


def test_a_parameter_picks_the_engine() -> None:
    fakes, pool = Fakes(), EnginePool(2)
    pool.register("dense", fakes.start("dense"), fakes.stop, uses("pair", "dense"))
    pool.register("hybrid", fakes.start("hybrid"), fakes.stop, uses("pair", "hybrid"))
    pool.register("shared", fakes.start("shared"), fakes.stop)
    pool.needs("shared", uses("pair", "hybrid"))
    assert pool.plan([item("pair", pair="hybrid")]) == ["hybrid", "shared"]
    assert pool.plan([item("pair")]) == []  # the fixture without that parameter
    assert pool.plan([item("pair", pair="dense"), item("pair", pair="hybrid")]) == ["dense", "hybrid", "shared"]


def test_one_at_a_time_starts_nothing_ahead_and_stops_before_returning() -> None:
    fakes, pool = Fakes(), EnginePool(1)
    pool.register("a", fakes.start("a"), fakes.stop, uses("fa"))
    pool.register("b", fakes.start("b"), fakes.stop, uses("fb"))
    pool.plan([item("fa"), item("fb")])
    a = pool.take("a")
    assert fakes.started == ["a"]
    pool.give_back("a", a)
    assert fakes.stopped == [a]
    assert pool.close() == []


def test_an_engine_started_ahead_that_no_test_took_is_stopped_at_close() -> None:
    fakes, pool = Fakes(), EnginePool(2)
    pool.register("a", fakes.start("a"), fakes.stop, uses("fa"))
    pool.register("b", fakes.start("b"), fakes.stop, uses("fb"))
    pool.plan([item("fa"), item("fb")])
    a = pool.take("a")  # b starts beside it; its test never runs (say, -x stopped the session)
    pool.give_back("a", a)
    assert pool.close() == []
    assert sorted(e[0] for e in fakes.stopped) == ["a", "b"] and pool.started() == []


def test_a_failed_start_raises_where_the_engine_is_taken_and_the_next_take_retries() -> None:
    fakes, pool = Fakes(), EnginePool(2)
    attempts = {"n": 0}

    def flaky() -> Any:
        attempts["n"] += 1
        if attempts["n"] == 1:
            raise RuntimeError("vllm serve exited with 1")
        return ("b", attempts["n"])

    pool.register("a", fakes.start("a"), fakes.stop, uses("fa"))
    pool.register("b", flaky, fakes.stop, uses("fb"))
    pool.plan([item("fa"), item("fb")])
    a = pool.take("a")  # b's first start fails in the background: nobody has asked for it yet
    with pytest.raises(RuntimeError, match="vllm serve exited"):
        pool.take("b")
    b = pool.take("b")
    assert b == ("b", 2)
    pool.give_back("a", a)
    pool.give_back("b", b)
    assert pool.close() == []


def test_a_start_ahead_that_failed_and_was_never_taken_is_reported_at_close() -> None:
    fakes, pool = Fakes(), EnginePool(2)
    pool.register("a", fakes.start("a"), fakes.stop, uses("fa"))
    pool.register("b", fakes.start("b", fail=True), fakes.stop, uses("fb"))
    pool.plan([item("fa"), item("fb")])
    pool.give_back("a", pool.take("a"))
    errors = pool.close()
    assert [str(e) for e in errors] == ["b did not start"]


def test_misuse_is_a_clear_error() -> None:
    fakes, pool = Fakes(), EnginePool(2)
    pool.register("a", fakes.start("a"), fakes.stop)
    with pytest.raises(ValueError, match="registered twice"):
        pool.register("a", fakes.start("a"), fakes.stop)
    with pytest.raises(KeyError, match="no engine 'nope' is registered"):
        pool.take("nope")
    a = pool.take("a")
    with pytest.raises(RuntimeError, match="taken already"):
        pool.take("a")
    pool.give_back("a", a)
    with pytest.raises(ValueError):
        EnginePool(0)
    assert pool.close() == []


def test_a_take_interrupted_while_its_engine_starts_leaves_the_engine_to_close() -> None:
    """Ctrl-C while a fixture waits for its engine: the start goes on, and close() stops the engine
    once it is up, instead of leaving a `vllm serve` nobody owns."""
    fakes, pool = Fakes(), EnginePool(2)
    release = threading.Event()

    def slow() -> Any:
        release.wait(timeout=10)
        return fakes.start("a")()

    pool.register("a", slow, fakes.stop, uses("fa"))
    pool.plan([item("fa")])

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGUSR1, interrupt)  # a real signal wakes the waiting take, as Ctrl-C does
    try:
        threading.Timer(0.2, signal.pthread_kill, args=(threading.main_thread().ident, signal.SIGUSR1)).start()
        with pytest.raises(KeyboardInterrupt):
            pool.take("a")
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert pool.started() == ["a"]
    release.set()
    assert pool.close() == []
    assert [e[0] for e in fakes.stopped] == ["a"]


NAMES = ["a", "b", "c", "d"]


@settings(max_examples=60, deadline=None)
@given(
    width=st.integers(1, 3),
    needed=st.lists(st.sampled_from(NAMES), max_size=8),
    taken=st.lists(st.sampled_from(NAMES), max_size=8),
)
def test_every_engine_started_is_stopped_exactly_once(width: int, needed: list[str], taken: list[str]) -> None:
    """Whatever the plan and whichever engines the tests then take (in any order, each given back
    before it is taken again), every engine started is stopped once, and one take starts at
    most `width` engines."""
    fakes, pool = Fakes(), EnginePool(width)
    for name in NAMES:
        pool.register(name, fakes.start(name), fakes.stop, uses("f" + name))
    pool.plan([item("f" + n) for n in needed])
    for name in taken:
        before = set(pool.started())
        engine = pool.take(name)
        assert engine[0] == name
        assert len(set(pool.started()) - before) <= width
        pool.give_back(name, engine)
    assert pool.close() == []
    assert sorted(serial for _, serial in fakes.stopped) == list(range(1, fakes.serial + 1))


@pytest.mark.parametrize("raw,expected", [("1", 1), ("3", 3), (" 2 ", 2)])
def test_the_variable_sets_how_many_engines_start_at_once(raw: str, expected: int) -> None:
    assert side_by_side({STARTS_ENV: raw}) == expected


@pytest.mark.parametrize("raw", ["0", "-1", "two", "1.5"])
def test_a_bad_value_is_a_usage_error_naming_the_variable(raw: str) -> None:
    with pytest.raises(pytest.UsageError, match=STARTS_ENV):
        side_by_side({STARTS_ENV: raw})
