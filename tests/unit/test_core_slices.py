"""KvHintCore.submit_slice: long read-side work (snapshots) gets a bounded share of each
engine step, after the step's ordinary tasks, and never starves them."""

from __future__ import annotations

import time

import pytest
from kvhint_unit_support import FakeEngine, local_engine_info

from kvhint_server import KvHintCore, ServerConfig
from kvhint_server.core import SLICE_BUDGET_S, EngineStopped


def _core() -> KvHintCore:
    core = KvHintCore(ServerConfig())
    core.attach(FakeEngine(core, local_engine_info()))  # not started: the test runs the steps
    return core


def _until_deadline(deadline: float) -> float:
    while time.perf_counter() < deadline:
        pass
    return deadline


def test_slices_share_one_budget_per_step_and_tasks_run_first():
    core = _core()
    order: list[str] = []
    slices = [core.submit_slice(lambda d, i=i: (order.append(f"slice{i}"), _until_deadline(d))) for i in range(3)]
    task = core.submit(lambda: order.append("task"))
    start = time.perf_counter()
    core.run_pending()
    elapsed = time.perf_counter() - start
    # The task ran first; one slice used the whole budget, so the others wait for later steps.
    assert order == ["task", "slice0"] and task.done()
    assert [f.done() for f in slices] == [True, False, False]
    assert elapsed < SLICE_BUDGET_S + 0.5  # returned after one budget (loose: a loaded CI machine); `order` shows the rest waited
    assert core.has_pending()
    core.run_pending()
    core.run_pending()
    assert order == ["task", "slice0", "slice1", "slice2"] and not core.has_pending()


def test_short_slices_share_a_step():
    core = _core()
    done = [core.submit_slice(lambda d: d) for _ in range(5)]
    core.run_pending()
    assert all(f.done() for f in done), "slices that return at once all fit in one step"


def test_stop_fails_queued_slices():
    core = _core()
    pending = core.submit_slice(lambda d: d)
    core.stop()
    with pytest.raises(EngineStopped):
        pending.result(0)
    with pytest.raises(EngineStopped):
        core.submit_slice(lambda d: d).result(0)
