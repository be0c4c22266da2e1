"""Fixtures for the engine-neutral client tests (tests/client): an in-process fake server.
These do not start vLLM; tests against the real engine live elsewhere (marker `engine`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fake_kvhint_server import RunningServer, start_fake_server


@pytest.fixture
def fake() -> Iterator[RunningServer]:
    server = start_fake_server()
    try:
        yield server
    finally:
        server.stop()

