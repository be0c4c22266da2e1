"""Fixtures for tests/unit: a real KvHintServer over a fake engine adapter."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kvhint_unit_support import Harness


@pytest.fixture
def make_harness() -> Iterator[Callable[..., Harness]]:
    """Factory: make_harness(info=None, **ServerConfig overrides) -> Harness.
    Every harness is stopped at teardown, and the fake engine must not have
    seen an engine-thread method called from another thread."""
    made: list[Harness] = []

    def make(**kw: Any) -> Harness:
        harness = Harness(**kw)
        made.append(harness)
        return harness

    yield make
    for harness in made:
        harness.close()
    for harness in made:
        assert harness.engine.violations == [], "adapter methods called off the engine thread"


@pytest.fixture
def harness(make_harness: Callable[..., Harness]) -> Harness:
    return make_harness()
