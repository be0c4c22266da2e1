"""KvHintServer lifecycle over loopback gRPC with the fake engine: health turns
NOT_SERVING before the engine refuses work, stop() closes the /metrics endpoint, and a
stalled engine does not collect tenant-usage metric tasks."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from kvhint_server import KvHintCore, KvHintServer, ServerConfig
from kvhint_server.metrics import KvHintMetrics

from kvhint_unit_support import FakeEngine, Harness, gate_engine_steps, local_engine_info


def test_health_says_not_serving_before_the_engine_refuses_work() -> None:
    """A probe must never see SERVING while RPCs already get UNAVAILABLE/SHUTTING_DOWN."""
    hs = Harness()
    health = health_pb2_grpc.HealthStub(hs.channel)
    seen: list[str] = []
    real_stop = hs.core.stop

    def stop() -> None:  # the moment the engine starts refusing tasks
        for service in ("", "kvhint.v1.KvHintService"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status
            seen.append(health_pb2.HealthCheckResponse.ServingStatus.Name(status))
        real_stop()

    hs.core.stop = stop  # type: ignore[method-assign]
    try:
        assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status == health_pb2.HealthCheckResponse.SERVING
        hs.server.stop(grace=0.5)
        assert seen == ["NOT_SERVING", "NOT_SERVING"]
    finally:
        hs.core.stop = real_stop  # type: ignore[method-assign]
        hs.close()


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _metrics_answer(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def test_stop_closes_the_metrics_endpoint_and_a_second_server_can_serve_it_again() -> None:
    port = _free_port()
    metrics = KvHintMetrics(CollectorRegistry())
    for _ in range(2):
        cfg = ServerConfig(address="127.0.0.1:0", metrics_address=f"127.0.0.1:{port}")
        core = KvHintCore(cfg)
        engine = FakeEngine(core, local_engine_info())
        core.attach(engine)
        engine.start()
        server = KvHintServer(core, cfg, metrics=metrics)
        try:
            server.start()  # the second time: no ConfigError "address in use"
            assert _metrics_answer(port)
        finally:
            server.stop(grace=0.2)
            engine.stop()
        assert not _metrics_answer(port)
        assert not [t for t in threading.enumerate() if t.is_alive() and t.name.startswith("kvhint")]


@pytest.fixture
def tenants_file(tmp_path: Path) -> str:
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": [{"name": "team-a", "session_prefix": "a/", "tokens": ["tok-a"],
                                             "pin_budget_blocks": 4}]}))
    return str(path)


def test_a_stalled_engine_does_not_pile_up_tenant_usage_tasks(tenants_file: str) -> None:
    """While the engine thread is in a long forward pass, each metrics sample of the
    tenants' budget use must not queue one more engine task (the queue depth is what
    bounded RPC work is refused on)."""
    hs = Harness(tenants_file=tenants_file)
    running = gate_engine_steps(hs)
    try:
        running.clear()
        time.sleep(0.05)
        for _ in range(3):
            assert hs.server._tenant_usage() == []  # the engine is busy: this sample is skipped
        assert hs.core.pending_tasks() == 1
        running.set()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and hs.core.pending_tasks():
            time.sleep(0.01)
        rows = hs.server._tenant_usage()
        assert ("team-a", "pin", 0, 4) in rows
        assert hs.core.pending_tasks() == 0
    finally:
        running.set()
        hs.close()
