"""Real-engine fixtures (see engine_support for the harness).

The two shared engines, `engine` (the dense model, inline bookkeeping) and `hybrid_engine` (the
Gemma 2 hybrid, deferred bookkeeping), are session fixtures in tests/shared_engines.py, which the
conformance tests use too. Tests that must hold on both take `any_engine` or `any_clean`, which
run the test once per model.
"""

from __future__ import annotations

import pytest
from engine_pool import uses
from engine_support import Engine
from shared_engines import POOL

MODELS = ("dense", "hybrid")
# `any_engine` takes the shared engines by name: tell the pool which of its tests need which.
POOL.needs("engine", uses("any_engine", "dense"))
POOL.needs("hybrid_engine", uses("any_engine", "hybrid"))


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
