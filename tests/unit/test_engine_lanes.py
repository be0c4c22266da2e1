"""The engine tier's two lanes: how tests are split between them (tests/shared_engines.py), the
script that runs them side by side (scripts/engine_lanes.py)."""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from engine_pool import EnginePool, uses
from hypothesis import given, settings
from hypothesis import strategies as st
from shared_engines import split_lane

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import engine_lanes  # noqa: E402


def item(module: str, name: str, *fixtures: str) -> SimpleNamespace:
    return SimpleNamespace(nodeid=f"{module}::{name}", fixturenames=list(fixtures))


# ------------------------------------------------------------------ the split


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcd"), st.booleans()), max_size=12))
def test_the_lanes_split_the_selected_tests_by_whole_modules(spec: list[tuple[str, bool]]) -> None:
    items = [item(f"tests/test_{m}.py", f"t{i}", *(["engine"] if pooled else [])) for i, (m, pooled) in enumerate(spec)]
    uses_pool = lambda it: "engine" in it.fixturenames  # noqa: E731
    pool, rest = split_lane(items, "pool", uses_pool)
    own, rest2 = split_lane(items, "own", uses_pool)
    # Each test in exactly one lane, in collection order; the other lane's are the deselected ones.
    assert sorted(map(id, pool + own)) == sorted(map(id, items))
    assert [i for i in items if i in pool] == pool and [i for i in items if i in own] == own
    assert rest == own and rest2 == pool
    # A module is one lane's: the pool lane's if any of its tests takes a pool engine.
    modules = lambda xs: {x.nodeid.split("::")[0] for x in xs}  # noqa: E731
    assert not modules(pool) & modules(own)
    assert modules(pool) == {f"tests/test_{m}.py" for m, pooled in spec if pooled}


def test_a_module_with_one_pool_test_goes_whole_to_the_pool_lane() -> None:
    pool = EnginePool(1)
    pool.register("shared", lambda: None, lambda e: None, uses("engine"))
    items = [item("tests/engine/test_tiers.py", "own_pair", "pair"),
             item("tests/engine/test_tiers.py", "both", "pair", "engine"),
             item("tests/engine/test_dp.py", "dp", "dp_engine")]
    assert [pool.needed_by(i) for i in items] == [[], ["shared"], []]
    kept, dropped = split_lane(items, "pool", lambda it: bool(pool.needed_by(it)))
    assert kept == items[:2] and dropped == items[2:]


# ------------------------------------------------------------------ the runner


def child(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def test_each_lanes_lines_come_prefixed_and_the_first_failing_lanes_status_is_returned() -> None:
    out = io.StringIO()
    rc = engine_lanes.run_lanes({
        "pool": child("print('a1'); print('a2', flush=True); raise SystemExit(0)"),
        "own": child("import sys; print('b1'); sys.stderr.write('b-err\\n'); raise SystemExit(3)"),
    }, out=out)
    assert rc == 3
    lines = out.getvalue().splitlines()
    assert [l for l in lines if l.startswith("[pool] ")] == ["[pool] a1", "[pool] a2"]
    assert sorted(l for l in lines if l.startswith("[own] ")) == ["[own] b-err", "[own] b1"]
    assert len(lines) == 4
    # Both fail: the pool lane's status first; a lane killed by a signal: 128 + its number.
    assert engine_lanes.run_lanes({"pool": child("raise SystemExit(1)"), "own": child("raise SystemExit(2)")}, out=io.StringIO()) == 1
    killed = child("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert engine_lanes.run_lanes({"pool": child("pass"), "own": killed}, out=io.StringIO()) == 128 + signal.SIGKILL
    assert engine_lanes.run_lanes({"pool": child("pass"), "own": child("pass")}, out=io.StringIO()) == 0


def test_sigterm_reaches_both_lanes_as_sigint_so_they_tear_down(tmp_path: Path) -> None:
    """A lane is a pytest process: SIGINT runs its fixtures' teardown (stopping engines), SIGTERM
    would not. The runner, sent SIGTERM, sends each lane SIGINT and waits for it."""
    lane = f"""
        import pathlib, sys, time
        ready = pathlib.Path({str(tmp_path)!r}) / sys.argv[1]
        try:
            ready.touch()
            time.sleep(60)
        except KeyboardInterrupt:
            print('teardown', sys.argv[1], flush=True)
            raise SystemExit(2)
    """
    runner = f"""
        import sys
        sys.path.insert(0, {str(ROOT / "scripts")!r})
        import engine_lanes
        lane = {textwrap.dedent(lane)!r}
        sys.exit(engine_lanes.run_lanes({{n: [sys.executable, "-c", lane, n] for n in ("pool", "own")}}))
    """
    proc = subprocess.Popen(child(runner), stdout=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 30
    while not ((tmp_path / "pool").exists() and (tmp_path / "own").exists()):
        assert time.monotonic() < deadline and proc.poll() is None, "the lanes never started"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert sorted(out.splitlines()) == ["[own] teardown own", "[pool] teardown pool"]


def test_the_lane_commands_are_the_engine_tier_with_each_lane() -> None:
    cmds = engine_lanes.lane_commands(Path("/r"), python="py")
    assert cmds == {
        "pool": ["py", "-u", "-m", "pytest", "-q", "-m", "engine", "--engine-lane=pool", "--junit-xml=/r/engine-pool.xml"],
        "own": ["py", "-u", "-m", "pytest", "-q", "-m", "engine", "--engine-lane=own", "--junit-xml=/r/engine-own.xml"],
    }


def test_one_after_another_runs_every_lane_in_order_and_returns_the_first_failure() -> None:
    out = io.StringIO()
    rc = engine_lanes.run_one_after_another({
        "pool": child("import time; time.sleep(0.3); print('first', flush=True); raise SystemExit(4)"),
        "own": child("print('second')"),
    }, out=out)
    assert rc == 4
    assert out.getvalue().splitlines() == ["[pool] first", "[own] second"]


@pytest.mark.parametrize(("starts", "at_once"), [("1", False), ("2", True)])
def test_the_lanes_run_side_by_side_only_where_engines_start_side_by_side(monkeypatch: pytest.MonkeyPatch, starts: str, at_once: bool) -> None:
    ran = []
    monkeypatch.setenv("KVHINT_TEST_ENGINE_STARTS", starts)
    monkeypatch.setattr(engine_lanes, "run_lanes", lambda cmds: ran.append(("at once", list(cmds))) or 0)
    monkeypatch.setattr(engine_lanes, "run_one_after_another", lambda cmds: ran.append(("in turn", list(cmds))) or 0)
    assert engine_lanes.main([]) == 0
    assert ran == [("at once" if at_once else "in turn", ["pool", "own"])]
