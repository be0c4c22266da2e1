"""Overload is bounded (issue 14, item 7): a bounded engine-thread queue, per-principal rate
limits and a per-step budget for hint work. Refusals are RESOURCE_EXHAUSTED with ErrorInfo and
google.rpc.RetryInfo and change nothing; deferred batches say how long they waited."""

from __future__ import annotations

import math
from collections import Counter
import threading
import time
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from hypothesis import given, settings
from hypothesis import strategies as st
from kvhint_unit_support import FakeEngine, Harness, error_info, h, local_engine_info, retain
from prometheus_client import CollectorRegistry

from kvhint.v1 import kvhint_pb2 as pb
from kvhint_client import ConnectionConfig, KvHintClient, KvHintError
from kvhint_client.config import RetryPolicy
from kvhint_server import KvHintCore, ServerConfig
from kvhint_server.config import ConfigError, check_environment
from kvhint_server.metrics import KvHintMetrics, MetricsExporter
from kvhint_server.overload import QueueFull, RateLimiter, TokenBucket, principal_of


def retry_info(err: grpc.RpcError) -> error_details_pb2.RetryInfo | None:
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            return info
    return None


class EngineGate:
    """Holds the fake engine thread inside one task until released."""

    def __init__(self, harness: Harness) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.future = harness.core.submit(lambda: (self.entered.set(), self.release.wait(10)))
        assert self.entered.wait(5), "the engine thread never ran the gate"


def _wait(predicate: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.002)


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


# ---------------------------------------------------------------- bounded queue


def test_a_flood_beyond_the_queue_bound_is_refused_with_retry_info_and_only_accepted_hints_apply(make_harness):
    harness = make_harness(max_pending_tasks=4)
    sessions = [f"s{i}" for i in range(20)]
    for i, s in enumerate(sessions):
        harness.engine.store([h(i)], session=s)
    gate = EngineGate(harness)
    calls = [harness.stub.ApplyHints.future(pb.ApplyHintsRequest(hints=[retain(s, 60, hint_id=f"r-{s}")]), timeout=10)
             for s in sessions]
    # 4 batches fit in the queue; the other 16 are answered at once, while the engine is held.
    _wait(lambda: sum(c.done() for c in calls) == 16)
    assert harness.core.pending_tasks() == 4
    gate.release.set()
    accepted, refused = [], []
    for s, call in zip(sessions, calls):
        try:
            assert call.result().results[0].outcome == pb.OUTCOME_ACCEPTED
            accepted.append(s)
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            info = error_info(err)
            assert info is not None and info.reason == "REASON_RESOURCE_EXHAUSTED"
            assert info.metadata["cause"] == "queue_full"
            delay = retry_info(err)
            assert delay is not None and 0 < delay.retry_delay.ToNanoseconds() <= 1_000_000_000
            refused.append(s)
    assert len(accepted) == 4 and len(refused) == 16
    # Exactly the accepted hints took effect; the refused ones changed nothing.
    granted = {s for i, s in enumerate(sessions) if h(i) in harness.core.ledger.grants}
    assert granted == set(accepted)
    assert harness.core.overload.queue_full == 16
    # The engine keeps serving, and a refused batch applies when retried.
    again = harness.apply(retain(refused[0], 60, hint_id=f"r-{refused[0]}"))
    assert again.results[0].outcome == pb.OUTCOME_ACCEPTED and not again.results[0].replayed


def test_internal_engine_work_is_never_refused_and_a_snapshot_subscription_is(make_harness):
    harness = make_harness(max_pending_tasks=2)
    gate = EngineGate(harness)
    internal = [harness.core.submit(lambda: None) for _ in range(5)]  # adapters' own work: unbounded
    assert harness.core.pending_tasks() == 5
    stream = harness.stub.WatchEvents(pb.WatchEventsRequest(start=pb.WatchEventsRequest.START_SNAPSHOT), timeout=5)
    with pytest.raises(grpc.RpcError) as exc:
        next(iter(stream))
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert retry_info(exc.value) is not None
    gate.release.set()
    for f in internal:
        f.result(5)
    assert harness.apply(retain("nobody", 5)).results[0].outcome == pb.OUTCOME_MISSING


def test_core_submit_bounded_fails_fast_and_queues_nothing():
    core = KvHintCore(ServerConfig(max_pending_tasks=1))
    core.attach(FakeEngine(core, local_engine_info()))  # not started: the test runs the steps
    ran: list[int] = []
    first = core.submit(lambda: ran.append(1), bounded=True)
    second = core.submit(lambda: ran.append(2), bounded=True)
    sliced = core.submit_slice(lambda d: ran.append(3), bounded=True)
    for refused in (second, sliced):
        with pytest.raises(QueueFull) as exc:
            refused.result(0)
        assert exc.value.retry_after > 0
    core.run_pending()
    assert ran == [1] and first.done() and not core.has_pending()


# ---------------------------------------------------------------- step budget


def test_a_step_budget_spreads_a_backlog_over_several_steps():
    budget_ms, task_s = 5.0, 0.002
    core = KvHintCore(ServerConfig(step_apply_budget_ms=budget_ms))
    core.attach(FakeEngine(core, local_engine_info()))
    futures = [core.submit(lambda: _busy(task_s)) for _ in range(12)]
    steps = 0
    while core.has_pending():
        core.run_pending()
        steps += 1
        assert steps <= 12, "every step runs at least one task"
    assert steps >= 3, "12 tasks of 2 ms do not fit one 5 ms budget"
    deferred = [f.deferred_steps for f in futures]
    assert deferred[0] == 0 and deferred == sorted(deferred) and deferred[-1] == steps - 1
    # A step stops at the first task boundary past its budget: tasks of >= 2 ms, at most 3 per 5 ms.
    assert max(Counter(deferred).values()) <= 3
    assert core.overload.budget_cutoffs == steps - 1


def test_no_budget_runs_the_whole_backlog_in_one_step():
    core = KvHintCore(ServerConfig(step_apply_budget_ms=0))
    core.attach(FakeEngine(core, local_engine_info()))
    futures = [core.submit(lambda: _busy(0.001)) for _ in range(10)]
    core.run_pending()
    assert all(f.done() and f.deferred_steps == 0 for f in futures)


def test_apply_hints_reports_the_steps_its_batch_waited(make_harness):
    harness = make_harness(step_apply_budget_ms=1.0)
    harness.engine.store([h(1)], session="a")
    assert harness.apply(retain("a", 30)).deferred_steps == 0  # an idle engine applies at once
    gate = EngineGate(harness)
    slow = [harness.core.submit(lambda: _busy(0.005)) for _ in range(3)]
    call = harness.stub.ApplyHints.future(pb.ApplyHintsRequest(hints=[retain("a", 60)]), timeout=10)
    _wait(lambda: harness.core.pending_tasks() == 4)
    time.sleep(0.01)  # the gate's step outlasts its budget too
    gate.release.set()
    response = call.result()
    # The gate's step and each 5 ms task's step spent the 1 ms budget before the batch ran.
    assert response.deferred_steps == 4
    assert response.results[0].outcome == pb.OUTCOME_ACCEPTED
    assert all(f.done() for f in slow)
    assert harness.core.overload.deferred_batches == 1


# ---------------------------------------------------------------- rate limits


def test_rate_limits_are_per_principal_and_say_when_to_retry(make_harness):
    harness = make_harness(rate_limit_hints_per_s=4, rate_limit_burst=3)
    for i, s in enumerate("abc"):
        harness.engine.store([h(i)], session=s)
    alice = (("authorization", "Bearer alice"),)
    bob = (("authorization", "Bearer bob"),)
    three = pb.ApplyHintsRequest(hints=[retain("a", 30), retain("b", 30), retain("c", 30)])
    assert len(harness.stub.ApplyHints(three, metadata=alice, timeout=5).results) == 3
    with pytest.raises(grpc.RpcError) as exc:
        harness.stub.ApplyHints(pb.ApplyHintsRequest(hints=[retain("a", 99, hint_id="late")]), metadata=alice, timeout=5)
    err = exc.value
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    info = error_info(err)
    assert info is not None and info.metadata["cause"] == "rate_limited"
    delay = retry_info(err)
    assert delay is not None
    wait_s = delay.retry_delay.ToNanoseconds() / 1e9
    assert 0 < wait_s <= 1 / 4
    # Bob's bucket is his own.
    assert len(harness.stub.ApplyHints(three, metadata=bob, timeout=5).results) == 3
    # The refused hint changed nothing (its hint id is unknown); after the delay it is admitted.
    time.sleep(wait_s)
    late = harness.stub.ApplyHints(pb.ApplyHintsRequest(hints=[retain("a", 99, hint_id="late")]), metadata=alice, timeout=5)
    assert not late.results[0].replayed
    assert harness.core.overload.rate_limited == 1


def test_a_batch_larger_than_the_burst_is_refused_without_retry_info(make_harness):
    harness = make_harness(rate_limit_hints_per_s=100, rate_limit_burst=2)
    with pytest.raises(grpc.RpcError) as exc:
        harness.apply(retain("a", 1), retain("b", 1), retain("c", 1))
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "split" in (exc.value.details() or "")
    assert retry_info(exc.value) is None


def test_a_batch_refused_as_a_whole_costs_no_rate_limit_tokens(make_harness):
    """An empty batch or one over max_hints_per_batch is INVALID_ARGUMENT (TOO_MANY_HINTS, as
    GetCapabilities' limits say), even when it is also over the burst, and it leaves the
    caller's bucket as it was: nothing was applied."""
    harness = make_harness(rate_limit_hints_per_s=0.01, rate_limit_burst=6, max_hints_per_batch=4)
    harness.engine.store([h(1)], session="a")
    for hints in ([retain("a", 1)] * 5, [retain("a", 1)] * 9, []):
        with pytest.raises(grpc.RpcError) as exc:
            harness.apply(*hints)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.value.details()
        assert error_info(exc.value).reason == ("REASON_TOO_MANY_HINTS" if hints else "REASON_MALFORMED_REQUEST")
    # The whole burst is still there: 4 + 2 hints go through, the next one is rate limited.
    assert len(harness.apply(*[retain("a", 1)] * 4).results) == 4
    assert len(harness.apply(*[retain("a", 1)] * 2).results) == 2
    with pytest.raises(grpc.RpcError) as exc:
        harness.apply(retain("a", 1))
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def _evict_hashes(first: int, n: int) -> pb.Hint:
    return pb.Hint(selector=pb.Selector(block_hashes=pb.BlockHashSelector(block_hashes=[h(i) for i in range(first, first + n)])),
                   evict=pb.EvictAction())


def test_block_hashes_are_bounded_per_batch_and_cost_by_the_64(make_harness):
    """A batch runs as one engine-thread task whose work grows with its selectors' hashes: more
    than max_block_hashes_per_batch over all of them is INVALID_ARGUMENT (TOO_MANY_HINTS, as
    GetCapabilities says, nothing applied, no tokens spent), and under a rate limit a hint costs
    one token per 64 of its hashes, so a caller's rate bounds its hashes, not just its hints."""
    harness = make_harness(rate_limit_hints_per_s=0.01, rate_limit_burst=100, max_block_hashes_per_batch=200)
    assert harness.stub.GetCapabilities(pb.GetCapabilitiesRequest(), timeout=5).limits.max_block_hashes_per_batch == 200
    harness.engine.store([h(i) for i in range(1, 301)], session="a")
    with pytest.raises(grpc.RpcError) as exc:
        harness.apply(_evict_hashes(1, 150), _evict_hashes(151, 51))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    info = error_info(exc.value)
    assert info.reason == "REASON_TOO_MANY_HINTS" and info.metadata["field"] == "hints", exc.value.details()
    assert "201 block hashes" in (exc.value.details() or "")
    assert len(harness.engine.device) == 300  # nothing evicted
    # 200 hashes: ceil(150/64) + ceil(50/64) = 3 + 1 tokens, and a session hint 1: 5 of the 100.
    assert len(harness.apply(_evict_hashes(1, 150), _evict_hashes(151, 50), retain("a", 1)).results) == 3
    for _ in range(18):  # 95 left: eighteen 5-token batches (hints of 65, 65 and 64 hashes: 2 + 2 + 1) go through ...
        harness.apply(_evict_hashes(1, 65), _evict_hashes(66, 65), _evict_hashes(131, 64))
    with pytest.raises(grpc.RpcError) as exc:  # ... and a 6-token one (65, 65, 65) does not fit the 5 left
        harness.apply(_evict_hashes(1, 65), _evict_hashes(66, 65), _evict_hashes(131, 65))
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(harness.apply(*[retain("a", 1)] * 5).results) == 5  # while 5 one-token hints do


def test_queries_cost_one_call(make_harness):
    harness = make_harness(rate_limit_hints_per_s=0.01, rate_limit_burst=2)
    md = (("authorization", "Bearer q"),)
    harness.stub.ListSessions(pb.ListSessionsRequest(), metadata=md, timeout=5)
    harness.stub.QueryResidency(pb.QueryResidencyRequest(selector=pb.Selector(session=pb.SessionSelector(session_id="x"))),
                                metadata=md, timeout=5)
    with pytest.raises(grpc.RpcError) as exc:
        harness.stub.ListSessions(pb.ListSessionsRequest(), metadata=md, timeout=5)
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    harness.stub.GetCapabilities(pb.GetCapabilitiesRequest(), metadata=md, timeout=5)  # free


class _Context:
    def __init__(self, metadata: tuple[tuple[str, str], ...], peer: str) -> None:
        self._metadata, self._peer = metadata, peer

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def peer(self) -> str:
        return self._peer


def test_principal_is_the_token_else_the_peer_host():
    a1 = principal_of(_Context((("authorization", "Bearer a"),), "ipv4:127.0.0.1:1000"))
    a2 = principal_of(_Context((("authorization", "Bearer a"),), "ipv4:10.0.0.1:2000"))
    b = principal_of(_Context((("authorization", "Bearer b"),), "ipv4:127.0.0.1:1000"))
    assert a1 == a2 != b and "Bearer" not in a1
    assert principal_of(_Context((), "ipv4:127.0.0.1:1000")) == principal_of(_Context((), "ipv4:127.0.0.1:1001"))
    assert principal_of(_Context((), "ipv6:[::1]:5")) != principal_of(_Context((), "ipv4:127.0.0.1:5"))


@settings(max_examples=200, deadline=None)
@given(
    rate=st.floats(0.5, 1000),
    burst=st.integers(1, 50),
    steps=st.lists(st.tuples(st.floats(0, 2), st.integers(1, 60)), min_size=1, max_size=60),
)
def test_a_token_bucket_never_admits_more_than_rate_times_t_plus_burst(rate, burst, steps):
    now, bucket = 0.0, TokenBucket(rate, burst, 0.0)
    admitted: list[tuple[float, int]] = []
    for dt, cost in steps:
        now += dt
        wait = bucket.take(cost, now)
        if wait == 0:
            admitted.append((now, cost))
        elif cost > burst:
            assert wait == math.inf
        else:
            # The advertised wait is enough: the same take then succeeds.
            probe = TokenBucket(rate, burst, 0.0)
            probe.tokens, probe.stamp = bucket.tokens, bucket.stamp
            assert probe.take(cost, now + wait * (1 + 1e-9) + 1e-12) == 0
    for i, (start, _) in enumerate(admitted):
        total = 0
        for t, cost in admitted[i:]:
            total += cost
            assert total <= rate * (t - start) + burst + 1e-6


def test_rate_limiter_refund_and_default_burst():
    clock = [0.0]
    limiter = RateLimiter(2.5, 0, clock=lambda: clock[0])
    assert limiter.default is not None and limiter.default.burst == 3
    assert limiter.take("p", 3) == 0
    assert limiter.take("p", 1) > 0
    limiter.give_back("p", 1)
    assert limiter.take("p", 1) == 0
    assert limiter.take("q", 3) == 0


# ---------------------------------------------------------------- config, metrics, client


@pytest.mark.parametrize(
    "var,raw",
    [
        ("KVHINT_MAX_PENDING_TASKS", "0"),
        ("KVHINT_MAX_PENDING_TASKS", "1.5"),
        ("KVHINT_STEP_APPLY_BUDGET_MS", "-1"),
        ("KVHINT_STEP_APPLY_BUDGET_MS", "nan"),
        ("KVHINT_RATE_LIMIT_HINTS_PER_S", "inf"),
        ("KVHINT_RATE_LIMIT_HINTS_PER_S", "lots"),
        ("KVHINT_RATE_LIMIT_BURST", "-3"),
    ],
)
def test_overload_settings_are_validated_naming_the_variable(var, raw):
    with pytest.raises(ConfigError, match=var):
        check_environment({var: raw})


def test_overload_settings_are_read_from_the_environment():
    config = check_environment({"KVHINT_MAX_PENDING_TASKS": "8", "KVHINT_STEP_APPLY_BUDGET_MS": "2.5",
                                "KVHINT_RATE_LIMIT_HINTS_PER_S": "100", "KVHINT_RATE_LIMIT_BURST": "200"})
    assert (config.max_pending_tasks, config.step_apply_budget_ms) == (8, 2.5)
    assert (config.rate_limit_hints_per_s, config.rate_limit_burst) == (100.0, 200)
    assert RateLimiter.from_config(ServerConfig()) is None  # unlimited by default


def test_overload_metrics(make_harness):
    harness = make_harness(max_pending_tasks=1, rate_limit_hints_per_s=0.01, rate_limit_burst=1)
    registry = CollectorRegistry()
    exporter = MetricsExporter(harness.core, KvHintMetrics(registry))
    gate = EngineGate(harness)
    blocker = harness.core.submit(lambda: None)
    md = lambda who: (("authorization", f"Bearer {who}"),)  # noqa: E731
    with pytest.raises(grpc.RpcError):  # queue full (the bucket is refunded)
        harness.stub.ApplyHints(pb.ApplyHintsRequest(hints=[retain("a", 1)]), metadata=md("x"), timeout=5)
    exporter.poll()
    value = registry.get_sample_value
    assert value("kvhint_engine_queue_depth") == 1
    gate.release.set()
    blocker.result(5)
    harness.stub.ApplyHints(pb.ApplyHintsRequest(hints=[retain("a", 1)]), metadata=md("x"), timeout=5)
    with pytest.raises(grpc.RpcError):  # rate limited
        harness.stub.ApplyHints(pb.ApplyHintsRequest(hints=[retain("a", 1)]), metadata=md("x"), timeout=5)
    exporter.poll()
    assert value("kvhint_rejections_total", {"cause": "queue_full"}) == 1
    assert value("kvhint_rejections_total", {"cause": "rate_limited"}) == 1
    assert value("kvhint_engine_queue_depth") == 0
    assert value("kvhint_deferred_batches_total") == 0


def test_client_reports_retry_after_and_can_retry_on_it(make_harness):
    harness = make_harness(rate_limit_hints_per_s=4, rate_limit_burst=1)
    harness.engine.store([h(1)], session="a")
    address = f"127.0.0.1:{harness.port}"
    plain = ConnectionConfig(address=address, bearer_token="c1", retry=RetryPolicy.disabled())
    with KvHintClient(plain) as kv:
        kv.apply(retain("a", 5))
        with pytest.raises(KvHintError) as exc:
            kv.apply(retain("a", 5))
        assert exc.value.is_overloaded and exc.value.metadata["cause"] == "rate_limited"
        assert exc.value.retry_after is not None and 0 < exc.value.retry_after <= 0.25
    patient = plain.replace(bearer_token="c2", retry=RetryPolicy(retry_resource_exhausted=True))
    with KvHintClient(patient) as kv:
        kv.apply(retain("a", 5))
        result = kv.apply(retain("a", 5))  # refused once, retried after RetryInfo's delay
        assert result.results[0].outcome == pb.OUTCOME_ACCEPTED
    assert harness.core.overload.rate_limited == 2
