"""Three tenancy gaps, over loopback gRPC with the fake engine:

* a ListSessions page token is the tenant's it was issued to: another tenant (or an admin)
  presenting it is refused INVALID_ARGUMENT on `page_token`, as any foreign token is;
* a WatchEvents snapshot's engine tasks (its first task and every slice) go through the
  calling tenant's share of the engine queue (overload.TenantQueueShares), so a tenant with
  many snapshot watches cannot fill the queue that another tenant's calls wait in;
* every RESOURCE_EXHAUSTED refusal of a WatchEvents call is counted in
  kvhint_rejections_total{cause} with the cause its ErrorInfo names.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry

from kvhint.v1 import kvhint_pb2 as pb
from kvhint_server import core as core_module
from kvhint_server.metrics import KvHintMetrics, MetricsExporter

from kvhint_unit_support import Harness, error_info, gate_engine_steps, h, local_engine_info

from test_tenant_watch_scope import ADMIN, TENANTS, A, B  # two tenants and an admin, with their call metadata


@pytest.fixture
def tenants_file(tmp_path: Path) -> str:
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(TENANTS))
    return str(path)


@pytest.fixture
def make(tenants_file: str) -> Iterator[Callable[..., Harness]]:
    made: list[Harness] = []

    def build(tenancy: bool = True, **overrides: object) -> Harness:
        if tenancy:
            overrides["tenants_file"] = tenants_file
        harness = Harness(local_engine_info(num_device_blocks=256), **overrides)
        made.append(harness)
        return harness

    yield build
    for harness in made:
        harness.close()


def _wait(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.002)


# ---------------------------------------------------------------- 1. ListSessions page tokens


def _refused_token(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    info = error_info(err.value)
    assert info is not None and info.metadata["field"] == "page_token", err.value.details()
    return err.value


def test_a_list_sessions_page_token_is_refused_to_another_tenant_and_to_an_admin(make) -> None:
    hx = make()
    for i, session in enumerate(["a/1", "a/2", "a/3", "b/1", "b/2"]):
        hx.engine.store([h(i + 1)], session=session)
    first = hx.stub.ListSessions(pb.ListSessionsRequest(page_size=1), metadata=A, timeout=5)
    assert [s.session_id for s in first.sessions] == ["a/1"] and first.next_page_token
    token = first.next_page_token
    for other in (B, ADMIN):  # same request, same epoch: only the caller differs
        _refused_token(lambda: hx.stub.ListSessions(pb.ListSessionsRequest(page_size=1, page_token=token),
                                                    metadata=other, timeout=5))
    admin_token = hx.stub.ListSessions(pb.ListSessionsRequest(page_size=1), metadata=ADMIN, timeout=5).next_page_token
    _refused_token(lambda: hx.stub.ListSessions(pb.ListSessionsRequest(page_size=1, page_token=admin_token),
                                                metadata=A, timeout=5))
    # The tenant it was issued to pages on, to the end.
    names, page_token = ["a/1"], token
    while page_token:
        page = hx.stub.ListSessions(pb.ListSessionsRequest(page_size=1, page_token=page_token), metadata=A, timeout=5)
        names += [s.session_id for s in page.sessions]
        page_token = page.next_page_token
    assert names == ["a/1", "a/2", "a/3"]


def test_without_tenancy_a_list_sessions_page_token_serves_any_caller(make) -> None:
    """Unchanged without a tenants file: a token is bound to the query, not to who presents it."""
    hx = make(tenancy=False)
    for i, session in enumerate(["s1", "s2", "s3"]):
        hx.engine.store([h(i + 1)], session=session)
    token = hx.stub.ListSessions(pb.ListSessionsRequest(page_size=1), metadata=(("authorization", "Bearer x"),),
                                 timeout=5).next_page_token
    page = hx.stub.ListSessions(pb.ListSessionsRequest(page_size=2, page_token=token),
                                metadata=(("authorization", "Bearer y"),), timeout=5)
    assert [s.session_id for s in page.sessions] == ["s2", "s3"]


# ---------------------------------------------------------------- 2. snapshots and the queue share


class StepGate:
    """The fake engine runs a step boundary only when allowed: `step()` lets one through, `open()`
    all from then on."""

    def __init__(self, hx: Harness) -> None:
        self._cv = threading.Condition()
        self._allowed = 0
        self._open = False
        real = hx.core.run_pending

        def run_pending() -> None:
            with self._cv:
                self._cv.wait_for(lambda: self._open or self._allowed > 0)
                if not self._open:
                    self._allowed -= 1
            real()

        hx.core.run_pending = run_pending  # type: ignore[method-assign]

    def step(self) -> None:
        with self._cv:
            self._allowed += 1
            self._cv.notify_all()

    def open(self) -> None:
        with self._cv:
            self._open = True
            self._cv.notify_all()


class Snapshot:
    """A START_SNAPSHOT WatchEvents call read on a thread, until its SnapshotEnd."""

    def __init__(self, hx: Harness, who) -> None:
        self.got: list[pb.WatchEventsResponse] = []
        self.error: grpc.RpcError | None = None
        self.ended = threading.Event()
        self.call = hx.stub.WatchEvents(pb.WatchEventsRequest(start=pb.WatchEventsRequest.START_SNAPSHOT),
                                        metadata=who, timeout=30)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for msg in self.call:
                self.got.append(msg)
                if msg.HasField("snapshot_end"):
                    break
        except grpc.RpcError as err:
            self.error = err
        finally:
            self.ended.set()

    def sessions(self) -> list[str]:
        return [m.snapshot_chunk.session_id for m in self.got if m.HasField("snapshot_chunk")]

    def close(self) -> None:
        self.call.cancel()
        self.thread.join(5)


def _list(hx: Harness, who) -> grpc.Future:
    return hx.stub.ListSessions.future(pb.ListSessionsRequest(), metadata=who, timeout=10)


def _outcome(future: grpc.Future) -> str:
    try:
        future.result(timeout=10)
        return "ok"
    except grpc.RpcError as err:
        return f"{err.code().name}: {err.details()}"


def test_a_tenants_snapshot_watches_count_against_its_queue_share(make) -> None:
    """Tenant A fills its share with ListSessions while the engine is in a long step, then opens
    snapshot watches: they are refused queue_full (A's share), not queued past it, and tenant B's
    call still gets a place in the engine queue."""
    hx = make(max_pending_tasks=4)  # a tenant's share: 2
    hx.engine.store([h(1)], session="a/1")
    steps = gate_engine_steps(hx)
    steps.clear()
    time.sleep(0.05)
    queued = [_list(hx, A) for _ in range(2)]
    _wait(lambda: hx.server.servicer.queue_shares.held("team-a") == 2, "A's ListSessions hold its share")
    snapshots = [Snapshot(hx, A) for _ in range(2)]
    try:
        for snap in snapshots:
            assert snap.ended.wait(5), "a snapshot watch past the tenant's share was queued"
            assert snap.error is not None and snap.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert error_info(snap.error).metadata["cause"] == "queue_full"
            assert "tenant 'team-a''s share of the engine queue is full" in snap.error.details()
        other = _list(hx, B)
        _wait(lambda: other.done() or hx.server.servicer.queue_shares.held("team-b") == 1, "B's call answered")
        steps.set()
        assert _outcome(other) == "ok"
        assert all(_outcome(f) == "ok" for f in queued)
    finally:
        steps.set()
        for snap in snapshots:
            snap.close()


def test_a_snapshots_slices_wait_in_the_tenants_share_and_another_tenant_still_gets_a_place(
    make, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four snapshots of tenant A, each a slice per session (and one slice per engine step), hold
    A's whole share (4 of an 8-task queue) while the engine is in a long step: A's next call is
    refused queue_full, B's calls get places, and once the engine runs every snapshot completes."""
    monkeypatch.setattr(core_module, "SLICE_BUDGET_S", 0.0)
    hx = make(max_pending_tasks=8)  # a tenant's share: 4
    sessions = [f"a/{i:02d}" for i in range(6)]
    for i, session in enumerate(sessions):
        hx.engine.store([h(i + 1)], session=session)
    hx.server.servicer.hub.snapshot_max_items = 1
    gate = StepGate(hx)
    snapshots = [Snapshot(hx, A) for _ in range(4)]
    try:
        _wait(lambda: hx.core.pending_tasks() == 4, "the snapshots' first tasks are queued")
        gate.step()  # runs the four first tasks: each snapshot then queues its first slice
        _wait(lambda: all(any(m.HasField("snapshot_begin") for m in s.got) for s in snapshots), "SnapshotBegin sent")
        _wait(lambda: hx.core.pending_tasks() == 4, "each snapshot's next slice is queued")
        flood = [_list(hx, A) for _ in range(4)]
        shares = hx.server.servicer.queue_shares
        _wait(lambda: all(f.done() for f in flood) or hx.core.pending_tasks() == 8, "A's calls are refused or queued")
        others = [_list(hx, B) for _ in range(4)]
        _wait(lambda: shares.held("team-b") == 4 or any(f.done() for f in others), "B's calls are queued or answered")
        refused_b = [_outcome(f) for f in others if f.done()]  # answered while the engine is held: refused
        assert not refused_b, refused_b
        refused_a = [_outcome(f) for f in flood if f.done()]
        assert len(refused_a) == 4 and all("tenant 'team-a''s share of the engine queue is full" in r
                                           for r in refused_a), refused_a
        gate.open()
        assert [_outcome(f) for f in others] == ["ok"] * 4
        for snap in snapshots:
            assert snap.ended.wait(10) and snap.error is None, snap.error
            assert sorted(snap.sessions()) == sessions
        _wait(lambda: hx.server.servicer.queue_shares.held("team-a") == 0, "A's places are given back")
    finally:
        gate.open()
        for snap in snapshots:
            snap.close()


# ---------------------------------------------------------------- 3. rejections_total


def _refusal(hx: Harness, who, **req: object) -> grpc.RpcError:
    call = hx.stub.WatchEvents(pb.WatchEventsRequest(**req), metadata=who, timeout=5)
    try:
        with pytest.raises(grpc.RpcError) as err:
            next(iter(call))
    finally:
        call.cancel()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
    return err.value


def test_every_refused_watch_events_call_is_counted_by_its_cause(make) -> None:
    hx = make(max_pending_tasks=2, rate_limit_hints_per_s=0.01, rate_limit_burst=4)
    registry = CollectorRegistry()
    exporter = MetricsExporter(hx.core, KvHintMetrics(registry))
    hub = hx.server.servicer.hub
    hub.max_streams_per_tenant, hub.max_streams = 1, 2
    causes: list[str] = []
    held = [hx.stub.WatchEvents(pb.WatchEventsRequest(), metadata=A, timeout=30)]
    hx.wait_subscribers(1)
    causes.append(error_info(_refusal(hx, A)).metadata["cause"])  # A's one stream is open
    held.append(hx.stub.WatchEvents(pb.WatchEventsRequest(), metadata=B, timeout=30))
    hx.wait_subscribers(2)
    causes.append(error_info(_refusal(hx, ADMIN)).metadata["cause"])  # the server's two are open
    for call in held:
        call.cancel()
    _wait(lambda: hub.lag()[0] == 0, "the streams are closed")
    steps = gate_engine_steps(hx)
    steps.clear()
    time.sleep(0.05)
    queued = [_list(hx, A), _list(hx, B)]  # the 2-task queue is full
    _wait(lambda: hx.core.pending_tasks() == 2, "the queue is full")
    causes.append(error_info(_refusal(hx, A, start=pb.WatchEventsRequest.START_SNAPSHOT)).metadata["cause"])
    steps.set()
    assert [_outcome(f) for f in queued] == ["ok", "ok"]
    for _ in range(2):  # B's bucket of 4: its stream and its ListSessions took 2 (refusals gave theirs back)
        try:
            next(iter(hx.stub.WatchEvents(pb.WatchEventsRequest(), metadata=B, timeout=0.3)))
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.details()
    causes.append(error_info(_refusal(hx, B)).metadata["cause"])
    assert causes == ["tenant_watch_streams", "watch_streams", "queue_full", "rate_limited"]
    exporter.poll()
    value = registry.get_sample_value
    assert {c: value("kvhint_rejections_total", {"cause": c}) for c in causes} == {c: 1.0 for c in causes}
