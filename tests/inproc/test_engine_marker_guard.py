"""The fast suite cannot start an engine by accident (see tests/conftest.py).

These tests carry no `engine` marker, so every way of starting an engine
must be refused here, before any process is spawned or model loaded.
"""

from __future__ import annotations

import os

import pytest

from engine_integration.served import ENGINE_FORBIDDEN_ENV, EngineSpec, ServedEngine


def test_an_unmarked_test_cannot_start_a_served_engine(tmp_path):
    served = ServedEngine(EngineSpec(model=str(tmp_path / "no-model")), log_path=tmp_path / "engine.log")
    with pytest.raises(RuntimeError, match="test_an_unmarked_test_cannot_start_a_served_engine .*no @pytest.mark.engine"):
        served.start(timeout=1)
    assert served.proc is None


@pytest.mark.parametrize(
    "module,name",
    [("vllm.v1.engine.llm_engine", "LLMEngine"), ("vllm.v1.engine.async_llm", "AsyncLLM"), ("vllm.v1.engine.core", "EngineCore")],
)
def test_an_unmarked_test_cannot_build_an_in_process_engine(module, name):
    cls = getattr(__import__(module, fromlist=[name]), name)
    with pytest.raises(RuntimeError, match=f"vLLM {name} refused: .*no @pytest.mark.engine"):
        cls(None, None, None)


@pytest.mark.engine
def test_a_marked_test_may_start_engines():
    assert ENGINE_FORBIDDEN_ENV not in os.environ
