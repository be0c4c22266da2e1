"""One replay of a trace on an engine (`replay`) for `bench.agentic_engine`: sends the
requests on the plan's causal schedule, drives the hints and returns a `RunRecord`.
"""

from __future__ import annotations

import heapq
import math
import os
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench.agentic_driver import HintDriver
from bench.agentic_monitor import Monitor
from bench.agentic_plan import ReplayPlan
from bench.agentic_served import EngineHandle
from bench.policy import PolicyConfig, policy_variant
from bench.runs import RequestRecord, RunRecord, RunSpec
from bench.trace import Trace


def now_wall() -> float:
    return time.time()


class ReplayError(RuntimeError):
    pass


def replay(
    engine: EngineHandle,
    trace: Trace,
    plan: ReplayPlan,
    spec: RunSpec,
    *,
    time_scale: float = 1.0,
    sequential: bool = False,
    tag: str | None = None,
    progress: Callable[[str], None] | None = None,
    progress_every_s: float = 10.0,
    request_timeout_s: float = 600.0,
    max_workers: int = 64,
    pin_budget_fraction: float | None = None,
) -> RunRecord:
    """Replay `trace` once on `engine` (cache assumed empty). `sequential`:
    one request at a time in trace order, no pauses, no signals (validation)."""
    from kvhint_client.openai_traffic import complete

    reqs = plan.requests
    n = len(reqs)
    tag = tag or spec.name
    usable = trace.header.num_gpu_blocks - 1

    def ns(sid: str) -> str:
        return f"{tag}/{sid}"

    def nc(cid: str) -> str:
        return f"{tag}/{cid}"

    monitor = Monitor(engine, usable)
    monitor.start()
    t0 = time.perf_counter()

    def clock() -> float:  # trace seconds since start
        return (time.perf_counter() - t0) / time_scale

    driver: HintDriver | None = None
    if spec.policy is not None and not sequential:
        library = spec.policy.startswith("library")
        cfg = None if library else policy_variant(spec.policy, PolicyConfig.from_header(trace.header))
        driver = HintDriver(engine.grpc_address, trace, cfg, ns, time_scale, clock, monitor,
                            library_tiers=spec.policy == "library+tiers")

    outputs: dict[str, list[int]] = {}
    records: list[RequestRecord | None] = [None] * n
    lock = threading.Condition()
    remaining = [len(d) for d in plan.deps]
    dependents = plan.dependents
    done_at: list[float | None] = [None] * n
    heap: list[tuple[float, int, int]] = []  # (due perf time, kind 0=request 1=timed signal, index)
    completed = 0
    failure: list[str] = []
    load0 = os.getloadavg()[0]

    def due_time(i: int) -> float:
        a = plan.anchor[i]
        if sequential:
            return 0.0
        if a is None:
            return t0 + reqs[i].t * time_scale
        return (done_at[a] or 0.0) + plan.delay[i] * time_scale

    def run_one(i: int) -> None:
        nonlocal completed
        r = reqs[i]
        rec: RequestRecord
        try:
            prompt = trace.expand_prompt(r, outputs)
            if driver is not None:
                driver.on_request(r.session_id)
            ts = time.perf_counter()
            ws = now_wall()
            c = complete(
                engine.http_url, prompt, session_id=ns(r.session_id), continuation_id=nc(r.continuation_id),
                parent_session_id=ns(r.parent_session_id) if r.parent_session_id else None,
                max_tokens=r.max_tokens, timeout=request_timeout_s, extra_body={"ignore_eos": True},
            )
            te = time.perf_counter()
            err = None
            if len(c.token_ids) != r.max_tokens:
                err = f"{r.request_id}: got {len(c.token_ids)} output tokens, expected {r.max_tokens}"
            rec = RequestRecord(
                i, r.request_id, r.session_id, c.prompt_tokens, len(prompt), c.cached_tokens, len(c.token_ids),
                r.max_tokens, c.ttft_s, c.latency_s, ts - t0, ts - t0 + c.ttft_s, te - t0, ws, now_wall(),
                nc(r.continuation_id), err,
            )
            outputs[r.request_id] = list(c.token_ids)
        except Exception as e:  # noqa: BLE001
            rec = RequestRecord(i, r.request_id, r.session_id, 0, 0, 0, 0, r.max_tokens, math.nan, math.nan,
                                math.nan, math.nan, math.nan, math.nan, math.nan, nc(r.continuation_id), repr(e))
        if rec.error is None and driver is not None:
            driver.on_signals(plan.signals_after[i], rec.continuation_id, r.session_id)
        with lock:
            records[i] = rec
            completed += 1
            if rec.error is not None:
                failure.append(rec.error)
            now = time.perf_counter()
            done_at[i] = now
            for j in dependents[i]:
                remaining[j] -= 1
                if remaining[j] == 0 and not sequential:
                    heapq.heappush(heap, (max(now, due_time(j)), 0, j))
            lock.notify_all()

    last_progress = time.perf_counter()

    def report_progress(force: bool = False) -> None:
        nonlocal last_progress
        if progress is None:
            return
        now = time.perf_counter()
        if not force and now - last_progress < progress_every_s:
            return
        last_progress = now
        done = [r for r in records if r is not None and r.error is None]
        p = sum(r.prompt_tokens for r in done)
        h = sum(r.cached_tokens for r in done)
        ttft = statistics.fmean(r.ttft_s for r in done) * 1000 if done else math.nan
        progress(f"[{tag}] {len(done)}/{n} requests, hit rate {h / p if p else 0:.3f}, "
                 f"mean TTFT {ttft:.0f} ms, {now - t0:.0f} s")

    if driver is not None:
        driver.start()
    try:
        if sequential:
            for i in range(n):
                run_one(i)
                if failure:
                    break
                report_progress()
        else:
            for i in range(n):
                if remaining[i] == 0:
                    heapq.heappush(heap, (due_time(i), 0, i))
            for k, sig in enumerate(plan.timed_signals):
                heapq.heappush(heap, (t0 + sig.t * time_scale, 1, k))
            with ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="bench-req") as pool:
                in_flight = 0

                def run_tracked(k: int) -> None:
                    nonlocal in_flight
                    try:
                        run_one(k)
                    finally:
                        with lock:
                            in_flight -= 1
                            lock.notify_all()

                while True:
                    batch: list[tuple[int, int]] = []
                    with lock:
                        if completed >= n or failure:
                            break
                        now = time.perf_counter()
                        while heap and heap[0][0] <= now:
                            _, kind, k = heapq.heappop(heap)
                            batch.append((kind, k))
                        if not batch:
                            if not heap and in_flight == 0:
                                raise ReplayError(f"run {spec.name}: replay stalled with {n - completed} requests "
                                                  "unsent (dependency cycle in the trace?)")
                            lock.wait(min(1.0, heap[0][0] - now) if heap else 1.0)
                        for kind, _ in batch:
                            if kind == 0:
                                in_flight += 1
                    for kind, k in batch:
                        if kind == 0:
                            pool.submit(run_tracked, k)
                        elif driver is not None:
                            pool.submit(driver.on_signals, [plan.timed_signals[k]], None)
                    report_progress()
    finally:
        makespan = time.perf_counter() - t0
        monitor.stop()
        hints: dict[str, Any] = {}
        if driver is not None:
            hints = {
                "outcomes": driver.outcomes,
                "rpcs": driver.hint_rpcs,
                "rpc_mean_ms": driver.hint_rpc_s / driver.hint_rpcs * 1000 if driver.hint_rpcs else 0.0,
                "prefix_retain_applications": driver.prefix_applications,
                "errors": driver.errors[:5],
            }
            driver.close()
    report_progress(force=True)
    if failure:
        raise ReplayError(f"run {spec.name}: {len(failure)} request(s) failed, first: {failure[0]}")
    recs = [r for r in records if r is not None]
    if len(recs) != n:
        raise ReplayError(f"run {spec.name}: only {len(recs)} of {n} requests completed")
    tiers = monitor.tier_delta()
    run = RunRecord(
        spec, recs, outputs, makespan,
        monitor={
            "peak_blocks_in_use": monitor.peak_in_use_blocks,
            "peak_resident_blocks": monitor.peak_resident,
            "pins_broken": monitor.pins_broken_events,
            "pins_broken_blocks": monitor.pins_broken_blocks,
            "preemptions": monitor.preemptions,
            "bytes_moved_between_tiers": tiers["tier_bytes"],
            "hint_operation_bytes": monitor.bytes_moved,
            "operations_completed": dict(monitor.operations_completed),
            "tier_cached_tokens": tiers["tier_cached_tokens"],
            "cached_tokens_by_source": tiers["by_source"],
            "usage_samples": len(monitor.usage_samples),
            "event_resyncs": monitor.resyncs,
            "cpu": monitor.cpu_total,
        },
        hints=hints,
        loadavg=(load0, os.getloadavg()[0]),
        usage_samples=monitor.usage_samples,
        cpu_samples=monitor.cpu_samples,
        admission=dict(monitor.first_store),
    )
    return run

