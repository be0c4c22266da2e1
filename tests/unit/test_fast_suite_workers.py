"""The fast suite (`pytest -m "not engine"`) runs on two xdist workers by itself; every other
selection, and the whole suite, stays in one process (tests/conftest.py, module doc)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def suite_conftest(request: pytest.FixtureRequest) -> ModuleType:
    for plugin in request.config.pluginmanager.get_plugins():
        if isinstance(plugin, ModuleType) and Path(getattr(plugin, "__file__", "")) == ROOT / "tests" / "conftest.py":
            return plugin
    raise AssertionError("tests/conftest.py is not loaded as a plugin")


def option(**kw: Any) -> SimpleNamespace:
    base: dict[str, Any] = dict(markexpr="not engine", numprocesses=None, usepdb=False, capture="fd", collectonly=False)
    base.update(kw)
    return SimpleNamespace(**base)


def test_only_the_fast_selection_gets_workers(suite_conftest: ModuleType) -> None:
    workers = suite_conftest.fast_suite_workers
    assert workers(option(), {}) == 2
    assert workers(option(markexpr="  not   engine "), {}) == 2
    for markexpr in ("", "engine", "not engine and not slow", "engine or not engine"):
        assert workers(option(markexpr=markexpr), {}) == 0, markexpr


def test_the_command_line_and_the_environment_decide_first(suite_conftest: ModuleType) -> None:
    workers = suite_conftest.fast_suite_workers
    assert workers(option(numprocesses=0), {}) == 0  # -n 0
    assert workers(option(numprocesses=3), {}) == 0  # -n 3: xdist's own, untouched
    no_xdist = option()
    del no_xdist.numprocesses  # -p no:xdist, or xdist not installed
    assert workers(no_xdist, {}) == 0
    assert workers(option(usepdb=True), {}) == 0
    assert workers(option(capture="no"), {}) == 0  # -s
    assert workers(option(collectonly=True), {}) == 0
    assert workers(option(), {"PYTEST_XDIST_WORKER": "gw0"}) == 0
    assert workers(option(), {"KVHINT_FAST_WORKERS": "0"}) == 0
    assert workers(option(), {"KVHINT_FAST_WORKERS": "1"}) == 0
    assert workers(option(), {"KVHINT_FAST_WORKERS": " 3 "}) == 3
    assert workers(option(), {"KVHINT_FAST_WORKERS": ""}) == 2


@pytest.mark.parametrize("raw", ["two", "-1", "1.5"])
def test_a_bad_worker_count_is_a_usage_error_naming_the_variable(suite_conftest: ModuleType, raw: str) -> None:
    with pytest.raises(pytest.UsageError, match="KVHINT_FAST_WORKERS"):
        suite_conftest.fast_suite_workers(option(), {"KVHINT_FAST_WORKERS": raw})


def test_pytest_m_not_engine_starts_two_workers() -> None:
    pytest.importorskip("xdist")
    # (this test may itself run on a fast-suite worker: the child is a fresh command line)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k != "KVHINT_FAST_WORKERS"}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "not engine", "-p", "no:cacheprovider",
         "tests/unit/test_fast_suite_workers.py::test_only_the_fast_selection_gets_workers"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 workers" in out.stdout and "1 passed" in out.stdout, out.stdout
