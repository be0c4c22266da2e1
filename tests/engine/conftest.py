"""Real-engine fixtures (see engine_support for the harness).

Two shared engines: `engine` serves the generated dense Llama (one KV-cache
group), `hybrid_engine` the generated Gemma 2 (a sliding-window and a
full-attention group). Tests that must hold on both take `any_engine` or
`any_clean`, which run the test once per model.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from engine_support import Engine, running_engine

from engine_integration.served import default_model

MODELS = ("dense", "hybrid")


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
    with running_engine(hybrid_model, zmq=True) as eng:
        yield eng


@pytest.fixture
def clean(engine: Engine) -> Engine:
    """The shared engine with an empty prefix cache, index and ledger."""
    engine.reset_cache()
    return engine


@pytest.fixture(params=MODELS)
def any_engine(request: pytest.FixtureRequest) -> Engine:
    """The shared dense engine, then the shared hybrid one."""
    return request.getfixturevalue("engine" if request.param == "dense" else "hybrid_engine")


@pytest.fixture
def any_clean(any_engine: Engine) -> Engine:
    """`any_engine` with an empty prefix cache, index and ledger."""
    any_engine.reset_cache()
    return any_engine
