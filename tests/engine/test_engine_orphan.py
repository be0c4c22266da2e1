"""A served engine whose API server dies by kill -9 (the OOM killer, a supervisor): vLLM 0.32's
EngineCore does not notice and waits on its input queue for good. With KvHint loaded, its sidecar
went on answering health SERVING and accepting hints for an engine no request could reach, and kept
its gRPC port, so a restart on the same ports failed after the model load. Now the sidecar stops
and EngineCore gets the SIGTERM its parent would have sent (engine_integration/parent_watch.py)."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest
from engine_processes import vllm_children

from engine_integration.served import EngineSpec, ServedEngine, free_port
from kvhint_client import KvHintClient

pytestmark = pytest.mark.engine


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit is reaped by whoever adopted it, maybe never)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_killing_the_api_server_stops_the_sidecar_and_engine_core(tiny_model: str) -> None:
    served = ServedEngine(EngineSpec(model=tiny_model, http_port=free_port(), grpc_port=free_port()))
    served.start()
    try:
        with KvHintClient(served.grpc_address) as client:
            assert client.health().serving
        api = served.proc.pid  # type: ignore[union-attr]
        cores = [pid for pid, name in vllm_children(api).items() if name.startswith("VLLM::EngineCor")]
        assert cores, vllm_children(api)
        os.kill(api, signal.SIGKILL)
        served.proc.wait(10)  # type: ignore[union-attr]
        deadline = time.monotonic() + 30
        while any(_running(pid) for pid in cores) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_running(pid) for pid in cores), "EngineCore outlived its API server"
        assert _bindable(served.grpc_port), "the sidecar's port is still bound"
        log = served.log_text()
        assert f"the process that started this EngineCore (pid {api}) exited without stopping it" in log
    finally:
        served.stop()
