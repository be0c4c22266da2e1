"""Real-engine fixtures (see engine_support for the harness)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from engine_support import Engine, running_engine

from engine_integration.served import default_model


@pytest.fixture(scope="session")
def tiny_model() -> str:
    return default_model("tiny")


@pytest.fixture(scope="session")
def engine(tiny_model: str) -> Iterator[Engine]:
    with running_engine(tiny_model, zmq=True) as eng:
        yield eng


@pytest.fixture
def clean(engine: Engine) -> Engine:
    """The shared engine with an empty prefix cache, index and ledger."""
    engine.reset_cache()
    return engine
