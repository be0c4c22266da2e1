"""KvHintScheduler validates every KVHINT_* value on its first line, before
vLLM's Scheduler builds anything (the path a stock `vllm serve
--scheduler-cls ...` takes, without the kvhint-vllm launcher)."""

from __future__ import annotations

import pytest

from engine_integration.scheduler import KvHintScheduler
from kvhint_server.config import ConfigError


def test_the_scheduler_refuses_a_bad_value_before_vllm_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVHINT_MAX_TTL_S", "inf")
    scheduler = object.__new__(KvHintScheduler)
    # No vLLM arguments at all: had vLLM's __init__ run first it would fail with
    # a TypeError, so a ConfigError naming the variable shows the check ran first.
    with pytest.raises(ConfigError, match="KVHINT_MAX_TTL_S"):
        KvHintScheduler.__init__(scheduler)
