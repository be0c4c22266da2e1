"""Data parallelism, in-process: two KvHint schedulers configured as ranks 0 and 1 of a dense
model's DP group exactly as vLLM's engine-core processes configure themselves (vLLM rewrites a
dense rank's ParallelConfig to look like DP=1; the rank survives in data_parallel_index).

Each rank's sidecar listens on port + rank and names its rank in GetCapabilities; a session is
found on the rank that served it; FleetClient and EventFollower, given all ranks' addresses,
route a session's hints to that rank only.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine_integration import inproc
from engine_integration.dp import free_base_port
from kvhint_client import KvHintClient, session
from kvhint_client.fleet import FleetClient, data_parallel_endpoints
from kvhint_client.follower import EventFollower

BLOCK = 16
PROMPTS = {"a": list(range(100, 100 + 4 * BLOCK)), "b": list(range(500, 500 + 3 * BLOCK))}


@pytest.fixture
def ranks() -> Iterator[tuple[list, str]]:
    """Ranks 0 and 1 of a 2-rank group; rank 0 served session a, rank 1 session b."""
    base = f"127.0.0.1:{free_base_port(2)}"
    made = []
    try:
        for rank, sid in enumerate(("a", "b")):
            scheduler = inproc.make_scheduler(num_blocks=32, data_parallel_rank=rank, data_parallel_size=2, grpc_address=base)
            made.append(scheduler)
            scheduler.add_request(inproc.make_request(f"{sid}-1", PROMPTS[sid], session_id=sid, max_tokens=2))
            assert inproc.run_until_idle(scheduler) == [f"{sid}-1"]
        yield made, base
    finally:
        for scheduler in made:
            inproc.close(scheduler)


def test_each_rank_listens_on_port_plus_rank_and_names_its_rank(ranks: tuple[list, str]) -> None:
    schedulers, base = ranks
    host, port = base.rsplit(":", 1)
    for rank, scheduler in enumerate(schedulers):
        assert scheduler.kvhint_server.address == f"{host}:{int(port) + rank}"
        with KvHintClient(scheduler.kvhint_server.address) as client:
            caps = client.capabilities(timeout=5)
        assert (caps.data_parallel_rank, caps.data_parallel_size) == (rank, 2)
    assert inproc.on_engine_thread(schedulers, lambda: data_parallel_endpoints(base)) == {
        "dp0": schedulers[0].kvhint_server.address,
        "dp1": schedulers[1].kvhint_server.address,
    }


def test_a_session_is_found_on_the_rank_that_served_it(ranks: tuple[list, str]) -> None:
    schedulers, _ = ranks

    def ask() -> list[tuple[list[str], int, int]]:
        out = []
        for scheduler in schedulers:
            with KvHintClient(scheduler.kvhint_server.address) as client:
                names = [s.session_id for s in client.list_sessions_page(timeout=5).sessions]
                a = len(client.query_residency_page(session("a").selector, timeout=5).blocks)
                b = len(client.query_residency_page(session("b").selector, timeout=5).blocks)
            out.append((names, a, b))
        return out

    assert inproc.on_engine_thread(schedulers, ask) == [(["a"], 4, 0), (["b"], 0, 3)]


def test_fleet_routes_each_sessions_hints_to_its_rank(ranks: tuple[list, str]) -> None:
    schedulers, base = ranks
    endpoints = inproc.on_engine_thread(schedulers, lambda: data_parallel_endpoints(base))

    def apply_by_asking() -> object:
        with FleetClient(endpoints) as fleet:
            return fleet.apply(session("a").pin(ttl=60, hint_id="pa"), session("b").retain(ttl=60, hint_id="rb"))

    out = inproc.on_engine_thread(schedulers, apply_by_asking)
    assert out.routes == {"pa": ["dp0"], "rb": ["dp1"]} and out.all_accepted
    assert out.per_engine["dp0"][0].affected_blocks[0].blocks == 4
    assert out.per_engine["dp1"][0].affected_blocks[0].blocks == 3


def test_follower_of_all_ranks_routes_without_asking(ranks: tuple[list, str]) -> None:
    schedulers, base = ranks
    endpoints = inproc.on_engine_thread(schedulers, lambda: data_parallel_endpoints(base))
    with EventFollower(endpoints) as follower:
        assert inproc.on_engine_thread(schedulers, lambda: follower.wait_synced(timeout=10), timeout=15)
        assert [r.engine for r in follower.index.engines_for_session("a")] == ["dp0"]
        assert [r.engine for r in follower.index.engines_for_session("b")] == ["dp1"]
        with FleetClient(endpoints, follower=follower) as fleet:
            assert fleet.engines_for(session("b").evict()) == (["dp1"], {})
            out = inproc.on_engine_thread(schedulers, lambda: fleet.apply(session("b").evict(hint_id="eb")))
        assert out.routes == {"eb": ["dp1"]} and out.all_accepted


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"data_parallel_size": 1, "data_parallel_rank": 0, "data_parallel_index": 0, "elastic_ep_max_dp_size": 1}, (0, 1)),
        # MoE ranks keep vLLM's DP fields.
        ({"data_parallel_size": 4, "data_parallel_rank": 3, "data_parallel_index": 3, "elastic_ep_max_dp_size": 4}, (3, 4)),
        # Dense rank after reconfigure_for_independent_dp_rank: rank and size survive elsewhere.
        ({"data_parallel_size": 1, "data_parallel_rank": 0, "data_parallel_index": 2, "elastic_ep_max_dp_size": 4}, (2, 4)),
    ],
)
def test_rank_and_size_from_vllms_parallel_config(fields: dict, expected: tuple[int, int]) -> None:
    from types import SimpleNamespace

    from engine_integration.dp import dp_rank_and_size

    assert dp_rank_and_size(SimpleNamespace(parallel_config=SimpleNamespace(enable_elastic_ep=False, **fields))) == expected


def test_data_parallel_ranks_get_their_own_sockets_and_one_metrics_endpoint(monkeypatch):
    """Rank r > 0 listens on port + r; a unix socket gets a path per rank (on one path the last
    rank to bind took it); in prometheus_client's multiprocess mode every endpoint serves every
    process's values, so only rank 0 serves KVHINT_METRICS_ADDRESS."""
    from types import SimpleNamespace

    from engine_integration import scheduler as sched_module

    def config_for(rank: int, **env: str):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_index=rank, data_parallel_size=2))
        return sched_module._config_for(vllm_config)

    monkeypatch.setattr(sched_module, "multiprocess_mode", lambda: False)
    tcp = {"KVHINT_GRPC_ADDRESS": "127.0.0.1:50151", "KVHINT_METRICS_ADDRESS": "127.0.0.1:9100"}
    assert (config_for(0, **tcp).address, config_for(0, **tcp).metrics_address) == ("127.0.0.1:50151", "127.0.0.1:9100")
    assert (config_for(1, **tcp).address, config_for(1, **tcp).metrics_address) == ("127.0.0.1:50152", "127.0.0.1:9101")
    assert config_for(1, KVHINT_GRPC_ADDRESS="unix:/tmp/kv.sock").address == "unix:/tmp/kv.sock.1"
    monkeypatch.setattr(sched_module, "multiprocess_mode", lambda: True)
    assert config_for(0, **tcp).metrics_address == "127.0.0.1:9100"
    assert config_for(1, **tcp).metrics_address == ""


def test_free_port_works_when_the_ephemeral_range_covers_every_high_port(monkeypatch):
    """With ip_local_port_range 1024 65535 there is no port outside the range above 10000: the
    engine tests' and benchmarks' free_port takes one from the kernel instead of failing."""
    import socket

    from engine_integration import served

    monkeypatch.setattr(served, "_ephemeral_range", lambda: (1024, 65535))
    port = served.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
