"""Fixtures for tests/inproc: vLLM's real KV cache code in this process (no model,
no engine process, no `engine` marker). See pool_support for the harness."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
from pool_support import Cache

if os.environ.get("KVHINT_HYPOTHESIS_REACH"):  # what the random tests reach (reach_events' doc)
    from reach_events import reach_events  # noqa: F401 (an autouse fixture)


@pytest.fixture
def make_cache() -> Callable[..., Cache]:
    """Factory: make_cache(num_blocks=24, hooked=True, **ServerConfig overrides) -> Cache."""
    return Cache


@pytest.fixture
def cache() -> Cache:
    """A hooked 24-block cache (23 usable: block 0 is vLLM's null block)."""
    return Cache(24)
