"""FleetClient routes hints to the engines holding what they select."""

from __future__ import annotations

import math
import time

import grpc
import pytest
from fake_kvhint_server import h, snapshot, start_fake_server

from kvhint.v1 import kvhint_pb2
from kvhint_client.builders import blocks, continuation, session
from kvhint_client.config import ConnectionConfig
from kvhint_client.errors import KvHintError
from kvhint_client.fleet import FleetClient, data_parallel_endpoints
from kvhint_client.follower import AsyncEventFollower, EngineTracker, EventFollower, ResidencyIndex


def _two_engines():
    a, b = start_fake_server(), start_fake_server()
    a.servicer.sessions = [kvhint_pb2.SessionInfo(session_id=s) for s in ("S", "S-child", "T")]
    b.servicer.sessions = [kvhint_pb2.SessionInfo(session_id="U")]
    b.servicer.blocks = [kvhint_pb2.BlockInfo(block_hash=h(1), tiers=[kvhint_pb2.TIER_DEVICE])]
    return a, b


def test_without_index_engines_are_asked() -> None:
    a, b = _two_engines()
    try:
        with FleetClient({"a": a.address, "b": b.address}) as fleet:
            out = fleet.apply(session("S").pin(ttl=5, hint_id="p"), session("U").evict(hint_id="u"),
                              continuation("c").release(hint_id="c"), session("nobody").evict(hint_id="n"))
        assert out.routes == {"p": ["a"], "u": ["b"], "c": ["b"], "n": []}
        assert [x.hint_id for x in a.servicer.applied] == ["p"]
        assert [x.hint_id for x in b.servicer.applied] == ["u", "c"], "one batch per engine, request order kept"
        assert [x.hint_id for x in out.unrouted] == ["n"] and not out.all_accepted
        assert set(out.results_for("p")) == {"a"} and out.per_engine["b"].all_accepted
    finally:
        a.stop()
        b.stop()


def test_with_index_routes_from_residency_and_reports_engine_errors() -> None:
    a, b = _two_engines()
    index = ResidencyIndex()
    for engine, sessions in (("a", {"S": [(1, [1])]}), ("b", {"S": [(1, [1]), (2, [1])], "V": [(7, [2])]})):
        tracker = EngineTracker(engine, engine, index)
        tracker.subscription()
        for message in snapshot("E", 1, sessions):
            tracker.handle(message)
    b.servicer.fail_next["ApplyHints"] = [grpc.StatusCode.PERMISSION_DENIED]
    try:
        with FleetClient({"a": a.address, "b": b.address}, follower=index) as fleet:
            out = fleet.apply(session("S").retain(ttl=5, hint_id="r"), blocks(h(7)).evict(hint_id="e"))
            assert out.routes == {"r": ["b", "a"], "e": ["b"]}
            assert a.servicer.count("ListSessions") == 0, "the index answered, no engine was asked"
            # "T" holds nothing the index knows of (e.g. only retention): the engines are asked.
            fallback = fleet.apply(session("T").release(hint_id="t"))
            assert fallback.routes == {"t": ["a"]} and a.servicer.count("ListSessions") == 1
        assert out.per_engine["a"].all_accepted
        assert out.errors["b"].code == grpc.StatusCode.PERMISSION_DENIED
    finally:
        a.stop()
        b.stop()


def _index_with(engines: dict[str, dict]) -> ResidencyIndex:
    """An index in which each engine has installed the snapshot of its sessions."""
    index = ResidencyIndex()
    for engine, sessions in engines.items():
        tracker = EngineTracker(engine, engine, index)
        tracker.subscription()
        for message in snapshot("E", 1, sessions):
            tracker.handle(message)
    return index


def test_engines_not_live_in_the_index_are_asked_too() -> None:
    """dp1's watch stream dropped (stalled, resyncing) while the engine still holds S: a Release
    the index resolves to dp0 also reaches dp1 (it used to reach dp0 only), asked in the same call."""
    dp0, dp1 = start_fake_server(), start_fake_server()
    for server in (dp0, dp1):
        server.servicer.sessions = [kvhint_pb2.SessionInfo(session_id="S")]
    index = _index_with({"dp0": {"S": [(1, [1]), (2, [1])]}, "dp1": {"S": [(1, [1])]}})
    index.set_live("dp1", False)
    try:
        with FleetClient({"dp0": dp0.address, "dp1": dp1.address}, follower=index) as fleet:
            out = fleet.apply(session("S").release(hint_id="rel"), blocks(h(2)).evict(hint_id="ev"), timeout=5)
            assert fleet.engines_for(session("S").release())[0] == ["dp0", "dp1"]
        assert out.routes == {"rel": ["dp0", "dp1"], "ev": ["dp0"]}, "dp1 holds S but not block 2"
        assert out.all_accepted and [x.hint_id for x in dp1.servicer.applied] == ["rel"]
        assert dp0.servicer.count("ListSessions") == 0 and dp0.servicer.count("QueryResidency") == 0, "the index answered for dp0"
        assert dp1.servicer.count("ListSessions") == 2 and dp1.servicer.count("QueryResidency") == 1
    finally:
        dp0.stop()
        dp1.stop()


@pytest.mark.parametrize("kind", [EventFollower, AsyncEventFollower])
def test_either_followers_index_routes_hints(kind) -> None:
    """An asyncio router's AsyncEventFollower routes like an EventFollower: FleetClient reads its
    index (before, only EventFollower was unwrapped, and apply() raised AttributeError)."""
    a, b = _two_engines()
    index = _index_with({"a": {"S": [(1, [1])]}, "b": {"V": [(7, [2])]}})
    follower = kind({"a": a.address, "b": b.address}, index=index)  # not started: the index is fed above
    try:
        with FleetClient({"a": a.address, "b": b.address}, follower=follower) as fleet:
            out = fleet.apply(session("S").retain(ttl=5, hint_id="r"), blocks(h(7)).evict(hint_id="e"), timeout=5)
        assert out.routes == {"r": ["a"], "e": ["b"]} and out.all_accepted
        assert a.servicer.count("ListSessions") == 0 and b.servicer.count("ListSessions") == 0, "the index answered"
    finally:
        a.stop()
        b.stop()


def test_a_follower_of_another_type_is_refused_at_construction() -> None:
    with pytest.raises(TypeError, match="follower must be an EventFollower, an AsyncEventFollower or a ResidencyIndex, got dict"):
        FleetClient({"a": "127.0.0.1:1"}, follower={"a": "S"})  # type: ignore[arg-type]


def test_a_repeated_hint_id_is_refused_before_anything_is_sent() -> None:
    """Two hints sharing an id (e.g. an envelope reusing action_id "0") used to be routed as one:
    both went to both engines, where the second was refused as a conflict."""
    a, b = _two_engines()
    try:
        with FleetClient({"a": a.address, "b": b.address}) as fleet:
            with pytest.raises(ValueError, match=r"hints\[2\]\.hint_id 'x' repeats hints\[0\]'s"):
                fleet.apply(session("S").release(hint_id="x"), session("S").pin(ttl=5), session("U").evict(hint_id="x"))
            asked = [s.servicer.count(m) for s in (a, b) for m in ("ApplyHints", "ListSessions", "QueryResidency")]
            assert asked == [0] * 6, "no engine was asked or sent anything"
            out = fleet.apply(session("S").release(), session("U").evict())  # ids the client assigns never repeat
        assert [x.WhichOneof("action") for x in a.servicer.applied] == ["release"]
        assert [x.WhichOneof("action") for x in b.servicer.applied] == ["evict"] and out.all_accepted
    finally:
        a.stop()
        b.stop()


def test_broadcast_sends_everything_everywhere() -> None:
    a, b = _two_engines()
    try:
        with FleetClient([a.address, b.address]) as fleet:
            out = fleet.apply(session("anything").release(hint_id="x"), broadcast=True)
        assert out.routes == {"x": [a.address, b.address]} and out.all_accepted
        assert len(a.servicer.applied) == len(b.servicer.applied) == 1
    finally:
        a.stop()
        b.stop()


def _consecutive_fake_servers(n: int) -> list:
    """n fake servers on ports p, p+1, ... (a data-parallel engine's port layout)."""
    for _ in range(50):
        first = start_fake_server()
        port = int(first.address.rsplit(":", 1)[1])
        servers = [first]
        try:
            for rank in range(1, n):
                servers.append(start_fake_server(port=port + rank))
            return servers
        except RuntimeError:
            for server in servers:
                server.stop()
    raise RuntimeError("no run of free consecutive ports")


def _as_ranks(servers: list, size: int) -> None:
    for rank, server in enumerate(servers):
        server.servicer.capabilities.data_parallel_rank = rank
        server.servicer.capabilities.data_parallel_size = size


def test_data_parallel_endpoints_from_rank0_capabilities() -> None:
    servers = _consecutive_fake_servers(2)
    try:
        _as_ranks(servers, 2)
        servers[1].servicer.sessions = [kvhint_pb2.SessionInfo(session_id="on-rank-1")]
        endpoints = data_parallel_endpoints(servers[0].address)
        assert endpoints == {"dp0": servers[0].address, "dp1": servers[1].address}
        with FleetClient(endpoints) as fleet:
            out = fleet.apply(session("on-rank-1").pin(ttl=5, hint_id="p"))
        assert out.routes == {"p": ["dp1"]} and out.all_accepted
        assert [x.hint_id for x in servers[1].servicer.applied] == ["p"] and not servers[0].servicer.applied
    finally:
        for server in servers:
            server.stop()


def test_data_parallel_endpoints_checks_every_rank_names_itself() -> None:
    servers = _consecutive_fake_servers(2)
    try:
        _as_ranks(servers, 2)
        servers[1].servicer.capabilities.data_parallel_rank = 0  # another engine's rank 0 on port + 1
        with pytest.raises(KvHintError) as err:
            data_parallel_endpoints(servers[0].address)
        assert err.value.address == servers[1].address and "rank 0 of 2, expected rank 1 of 2" in err.value.details
        # A server that predates the DP fields (size 0) is one rank.
        _as_ranks(servers, 0)
        assert data_parallel_endpoints(servers[0].address) == {"dp0": servers[0].address}
    finally:
        for server in servers:
            server.stop()


def test_data_parallel_endpoints_reach_every_rank_with_the_given_token() -> None:
    """A server listening beyond loopback requires TLS or a token: a ConnectionConfig for rank 0
    gives every rank its settings, and the mapping keeps them for the FleetClient."""
    servers = _consecutive_fake_servers(2)
    try:
        _as_ranks(servers, 2)
        servers[1].servicer.sessions = [kvhint_pb2.SessionInfo(session_id="on-rank-1")]
        endpoints = data_parallel_endpoints(ConnectionConfig(servers[0].address, bearer_token="tok", default_timeout=7.0))
        assert {name: cfg.address for name, cfg in endpoints.items()} == {"dp0": servers[0].address, "dp1": servers[1].address}
        assert all(cfg.bearer_token == "tok" and cfg.default_timeout == 7.0 for cfg in endpoints.values())
        with FleetClient(endpoints) as fleet:
            assert fleet.apply(session("on-rank-1").pin(ttl=5, hint_id="p")).routes == {"p": ["dp1"]}
        for server in servers:
            seen = server.servicer.metadata_seen
            assert seen and all(m.get("authorization") == "Bearer tok" for m in seen)
    finally:
        for server in servers:
            server.stop()


def test_apply_timeout_bounds_the_whole_call_with_a_slow_engine() -> None:
    """One engine answering slowly costs the call its timeout once, not once per hint: routing asks
    it once, the engines left without time are reported, and nothing is sent after the deadline."""
    a, b = start_fake_server(), start_fake_server()
    a.servicer.sessions = [kvhint_pb2.SessionInfo(session_id=f"S{i}") for i in range(10)]
    b.servicer.delay["ListSessions"] = 2.0
    try:
        with FleetClient({"a": a.address, "b": b.address}) as fleet:
            started = time.monotonic()
            out = fleet.apply(*[session(f"S{i}").evict(hint_id=f"h{i}") for i in range(10)], timeout=0.5)
            took = time.monotonic() - started
        assert took < 1.5, f"apply(timeout=0.5) took {took:.1f}s"
        assert out.errors["b"].code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert b.servicer.count("ListSessions") == 1, "an engine that failed routing is not asked again"
        assert not b.servicer.applied
    finally:
        a.stop()
        b.stop()


def test_apply_routes_and_applies_within_the_timeout_when_every_engine_answers() -> None:
    a, b = _two_engines()
    b.servicer.delay["ListSessions"] = 0.05
    try:
        with FleetClient({"a": a.address, "b": b.address}) as fleet:
            out = fleet.apply(session("S").pin(ttl=5, hint_id="p"), session("U").evict(hint_id="u"), timeout=5)
        assert out.routes == {"p": ["a"], "u": ["b"]} and out.all_accepted and not out.errors
    finally:
        a.stop()
        b.stop()


def test_a_batch_over_an_engines_limits_is_refused_before_any_engine_applies() -> None:
    a, b = start_fake_server(), start_fake_server()
    b.servicer.capabilities.limits.max_hints_per_batch = 1
    try:
        with FleetClient({"a": a.address, "b": b.address}) as fleet:
            fleet.client("b").capabilities()  # the limits are known once read
            with pytest.raises(ValueError, match="at most 1 per batch"):
                fleet.apply(session("X").evict(), session("Y").evict(), broadcast=True)
            assert not a.servicer.applied and not b.servicer.applied
            for bad in (0, math.inf, math.nan, 1e10):
                with pytest.raises(ValueError, match="timeout must be a finite number of seconds > 0 and at most 2147483648"):
                    fleet.apply(session("X").evict(), timeout=bad)
    finally:
        a.stop()
        b.stop()
