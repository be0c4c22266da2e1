"""Campaign phase 6: growth of sessions that share a system prompt.

Engine-neutral part: bench.snapshot_scale.measure(N) grows N sessions on one
shared prefix through the real KvHintCore and takes a START_SNAPSHOT
snapshot in slices; a step that costs the engine thread more than
SNAPSHOT_STEP_TARGET_MS of CPU is a missed target, reported in the table
(PhaseResult.miss).

Served part: `sessions` completions, each the shared system prompt plus one
block of its own, on the real engine; then a START_SNAPSHOT follower
connects while completions continue, and at a quiescent point it must agree
with ListSessions and QueryResidency.
"""

from __future__ import annotations

import statistics
import threading
import time

from bench.snapshot_scale import measure
from engine_integration.served import ServedEngine
from kvhint_client import KvHintClient
from kvhint_client.follower import EventFollower
from kvhint_client.openai_traffic import complete

from .campaign_model import PhaseResult, latest_sequence, tokens
from .campaign_routers import ENGINE, SYSTEM, EventCounter, disagreements, follower_lost, wait_caught_up

SNAPSHOT_STEP_TARGET_MS = 10.0


def run_core(sessions: int) -> PhaseResult:
    result = PhaseResult(f"growth to {sessions:,} sessions (core)")
    m = measure(sessions)
    result.tried = sessions
    step = float(m["snapshot_step_cpu_max_ms"])  # type: ignore[arg-type]
    if step > SNAPSHOT_STEP_TARGET_MS:
        result.miss(f"snapshot step cost {step:.1f} ms of engine CPU (target {SNAPSHOT_STEP_TARGET_MS} ms)")
    if int(m["snapshot_num_sessions"]) < sessions:  # type: ignore[call-overload]
        result.fail(f"the snapshot carried {m['snapshot_num_sessions']} of {sessions} sessions")
    result.details = m
    result.notes = (
        f"snapshot of {m['snapshot_num_sessions']:,} sessions in {m['snapshot_steps']} steps, engine CPU per step "
        f"max {step:.2f} ms (wall max {float(m['snapshot_step_max_ms']):.1f} ms); core memory {float(m['memory_mb']):.0f} MB "
        f"({float(m['memory_bytes_per_session']):,.0f} B/session)"
    )
    return result


def run_served(engine: ServedEngine, sessions: int) -> PhaseResult:
    result = PhaseResult(f"growth to {sessions} sessions (served engine)")
    failed_completions: list[str] = []

    def one(i: int, tag: str = "grow") -> float:
        t = time.perf_counter()
        try:
            complete(engine.http_url, SYSTEM + tokens(f"{tag}-{i}", 32), session_id=f"{tag}-{i:05d}")
        except Exception as exc:  # noqa: BLE001 - counted
            failed_completions.append(repr(exc)[:200])
        return (time.perf_counter() - t) * 1000

    before = [one(i) for i in range(sessions)]
    client = KvHintClient(engine.grpc_address)
    listed = len(client.list_sessions(prefix="grow-", page_size=1000))
    counter = EventCounter()
    follower = EventFollower({ENGINE: engine.grpc_address}, heartbeat=0.5, on_event=counter)
    during: list[float] = []
    stop = threading.Event()

    def traffic() -> None:
        i = 0
        while not stop.is_set():
            during.append(one(i, "grow-late"))
            i += 1

    t0 = time.monotonic()
    runner = threading.Thread(target=traffic, daemon=True)
    runner.start()
    try:
        follower.start()
        live = follower.wait_synced(60)
        to_live = time.monotonic() - t0
        stop.set()
        runner.join(120)
        if not live:
            result.fail("the START_SNAPSHOT follower did not go live within 60 s")
        target = latest_sequence(client)
        if not wait_caught_up([follower], target):
            result.fail("the follower did not catch up")
        compared, diffs = disagreements(client, follower)
        for why in failed_completions + diffs:
            result.fail(why)
        result.tried = sessions + len(during) + compared
        result.lost = follower_lost(follower)
        p50 = statistics.median(before)
        p50_during = statistics.median(during) if during else float("nan")
        result.details = {
            "sessions_listed_before_snapshot": listed, "follower_live_s": round(to_live, 2),
            "completion_p50_ms": round(p50, 1), "completion_p50_ms_during_snapshot": round(p50_during, 1),
            "completions_during_snapshot": len(during), "sessions_compared": compared, "disagreements": len(diffs),
            "events_received": counter.messages,
        }  # fmt: skip
        result.notes = (
            f"ListSessions held {listed} sessions; a START_SNAPSHOT follower went live in {to_live:.2f} s; completion p50 "
            f"{p50_during:.0f} ms during it vs {p50:.0f} ms before; {compared} sessions compared, {len(diffs)} disagreements"
        )
    finally:
        stop.set()
        follower.stop()
        client.close()
    return result
