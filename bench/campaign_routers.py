"""Campaign phases 2 and 4: routers with traffic, and a stuck subscriber.

Phase 2: R router threads, each with its own KvHintClient and EventFollower
(unfiltered WatchEvents), send completions for their sessions (a shared
system prompt plus a per-session prefix) and random hints (Retain, Pin,
Release, Evict) on any router's sessions. Every hint's outcome must be one
the proto documents for that action (REJECTED with a stated reason). At the
end, with traffic stopped and every follower caught up to the server's
sequence (a quiescent point), each follower's index must equal
QueryResidency and ListSessions, session by session and tier by tier.
Events are lost when a follower sees a sequence gap or is resynced.

Phase 4: one WatchEvents subscriber stops reading while hint bursts with
large events and completions continue. Completion latency must stay within
1.3x + 2 ms of the quiet median, the healthy follower must lose nothing, and
the stuck subscriber must be ended with a SUBSCRIBER_OVERFLOW resync.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from typing import Any, Optional

import grpc
from google.protobuf import duration_pb2

from engine_integration.served import ServedEngine
from kvhint.v1 import kvhint_pb2 as pb
from kvhint.v1 import kvhint_pb2_grpc as pbg
from kvhint_client import KvHintClient
from kvhint_client.follower import EventFollower
from kvhint_client.openai_traffic import complete
from kvhint_server.config import ServerConfig

from .campaign_model import PhaseResult, latest_sequence, session_selector, tokens

ENGINE = "e"
TIERS = (pb.TIER_DEVICE, pb.TIER_HOST, pb.TIER_DISK)
SYSTEM = tokens("campaign-system", 64)  # two blocks every session shares
O = pb.Outcome
R = pb.Reason
# Outcomes the proto documents per action, and the reasons a REJECTED may carry.
DOCUMENTED = {
    "retain": ({O.Value("OUTCOME_ACCEPTED"), O.Value("OUTCOME_CLIPPED"), O.Value("OUTCOME_MISSING")}, set()),
    "pin": (
        {O.Value("OUTCOME_ACCEPTED"), O.Value("OUTCOME_CLIPPED"), O.Value("OUTCOME_MISSING"), O.Value("OUTCOME_REJECTED")},
        {R.Value("REASON_PIN_BUDGET"), R.Value("REASON_RESOURCE_EXHAUSTED"), R.Value("REASON_PINNED_BY_OTHER_SESSION")},
    ),
    "release": ({O.Value("OUTCOME_ACCEPTED"), O.Value("OUTCOME_MISSING")}, set()),
    "evict": ({O.Value("OUTCOME_ACCEPTED"), O.Value("OUTCOME_CLIPPED"), O.Value("OUTCOME_MISSING")}, set()),
}


def random_hint(rng: random.Random, session: str) -> tuple[str, pb.Hint]:
    action = rng.choice(sorted(DOCUMENTED))
    ttl = duration_pb2.Duration(seconds=rng.choice([30, 120, 10**9]))  # 10^9 s must be capped, not granted
    hint = pb.Hint(selector=session_selector(session))
    if action == "retain":
        hint.retain.CopyFrom(pb.RetainAction(priority=rng.randint(-5, 5), ttl=ttl))
    elif action == "pin":
        hint.pin.CopyFrom(pb.PinAction(ttl=ttl))
    elif action == "release":
        hint.release.SetInParent()
    else:
        hint.evict.SetInParent()
    return action, hint


def mis_answer(action: str, result: pb.HintResult) -> Optional[str]:
    outcomes, reasons = DOCUMENTED[action]
    if result.outcome not in outcomes:
        return f"{action}: {O.Name(result.outcome)}"
    if result.outcome == O.Value("OUTCOME_REJECTED") and result.reason not in reasons:
        return f"{action}: REJECTED/{R.Name(result.reason)}"
    return None


class EventCounter:
    """on_event callback: counts the non-heartbeat messages a follower received."""

    def __init__(self) -> None:
        self.messages = 0

    def __call__(self, engine: str, message: pb.WatchEventsResponse) -> None:
        if not message.HasField("heartbeat"):
            self.messages += 1


def follower_lost(follower: EventFollower) -> int:
    """Sequence gaps plus resyncs beyond the first snapshot, for the one engine followed."""
    status = follower.status()[ENGINE]
    return status.sequence_gaps + status.resyncs


def disagreements(client: KvHintClient, follower: EventFollower) -> tuple[int, list[str]]:
    """(sessions compared, the differences) between a follower and the server, at a quiescent point."""
    listed = {s.session_id for s in client.list_sessions(page_size=500)}
    followed = follower.index.sessions(ENGINE)
    diffs = []
    for session in sorted(listed | followed):
        if (session in listed) != (session in followed):
            diffs.append(f"{session}: ListSessions {'lists' if session in listed else 'omits'} it, the follower disagrees")
        residency = client.query_residency(session_selector(session), page_size=1000)
        for tier in TIERS:
            server = set(residency.hashes(tier))
            mine = set(follower.index.session_blocks(session, ENGINE, tier=tier))
            if server != mine:
                diffs.append(f"{session} {pb.Tier.Name(tier)}: server {len(server)} blocks, follower {len(mine)}")
    return len(listed | followed), diffs


def wait_caught_up(followers: list[EventFollower], target: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all((f.position(ENGINE) or ("", -1))[1] >= target for f in followers):
            return True
        time.sleep(0.05)
    return False


class Router(threading.Thread):
    def __init__(self, engine: ServedEngine, rid: int, routers: int, sessions: int, until: float, seed: int) -> None:
        super().__init__(name=f"campaign-router-{rid}", daemon=True)
        self.engine, self.rid, self.routers, self.sessions, self.until = engine, rid, routers, sessions, until
        self.rng = random.Random(f"{seed}-{rid}")
        self.counter = EventCounter()
        self.client = KvHintClient(engine.grpc_address)
        self.follower = EventFollower({ENGINE: engine.grpc_address}, heartbeat=0.5, on_event=self.counter)
        self.completions = self.completions_failed = self.hints = 0
        self.mis_answered: list[str] = []
        self.errors: list[str] = []

    def session(self, rid: Optional[int] = None) -> str:
        owner = self.rng.randrange(self.routers) if rid is None else rid
        return f"router{owner}-s{self.rng.randrange(self.sessions)}"

    def run(self) -> None:
        while time.monotonic() < self.until:
            session = self.session(self.rid)
            own = tokens(session, 32 * self.rng.randint(1, 4))
            self.completions += 1
            try:
                complete(self.engine.http_url, SYSTEM + own, session_id=session, timeout=120)
            except Exception as exc:  # noqa: BLE001 - counted as a failed completion
                self.completions_failed += 1
                self.errors.append(repr(exc)[:200])
            for _ in range(self.rng.randint(0, 2)):
                action, hint = random_hint(self.rng, self.session())
                self.hints += 1
                try:
                    result = self.client.apply(hint, timeout=30)[0]
                except Exception as exc:  # noqa: BLE001 - an RPC error is a mis-answer
                    self.mis_answered.append(f"{action}: {exc!r}"[:200])
                    continue
                if why := mis_answer(action, result):
                    self.mis_answered.append(why)

    def close(self) -> None:
        self.follower.stop()
        self.client.close()


def run_routers(engine: ServedEngine, routers: int, seconds: float, sessions: int = 4, seed: int = 14) -> PhaseResult:
    result = PhaseResult(f"{routers} routers + traffic")
    fleet = [Router(engine, r, routers, sessions, 0.0, seed) for r in range(routers)]
    try:
        for r in fleet:
            r.follower.start()
        if not all(r.follower.wait_synced(30) for r in fleet):
            result.fail("a follower did not go live within 30 s")
        until = time.monotonic() + seconds
        for r in fleet:
            r.until = until
            r.start()
        for r in fleet:
            r.join(seconds + 300)
        target = latest_sequence(fleet[0].client)
        if not wait_caught_up([r.follower for r in fleet], target):
            result.fail(f"followers did not reach sequence {target} within 30 s")
        compared = 0
        diffs: list[str] = []
        for r in fleet:
            n, d = disagreements(r.client, r.follower)
            compared += n
            diffs += [f"router {r.rid}: {x}" for x in d]
        completions = sum(r.completions for r in fleet)
        c_failed = sum(r.completions_failed for r in fleet)
        hints = sum(r.hints for r in fleet)
        mis = [m for r in fleet for m in r.mis_answered]
        events = sum(r.counter.messages for r in fleet)
        result.tried = completions + hints + compared
        result.lost = sum(follower_lost(r.follower) for r in fleet)
        for why in [*(e for r in fleet for e in r.errors), *mis, *diffs]:
            result.fail(why)
        result.failed += c_failed - sum(len(r.errors) for r in fleet)  # errors already counted above
        result.details = {
            "routers": routers, "seconds": seconds, "completions": completions, "completions_failed": c_failed,
            "hints": hints, "hints_mis_answered": len(mis), "events_received": events,
            "sessions_compared": compared, "follower_disagreements": len(diffs), "quiescent_sequence": target,
        }  # fmt: skip
        result.notes = (
            f"{completions} completions ({c_failed} failed), {hints} hints ({len(mis)} mis-answered), "
            f"{events} events received, {compared} session comparisons at the quiescent point "
            f"({len(diffs)} disagreements)"
        )
    finally:
        for r in fleet:
            r.close()
    return result


def _latency_ms(engine: ServedEngine, tag: str, n: int) -> list[float]:
    out = []
    for i in range(n):
        t = time.perf_counter()
        complete(engine.http_url, tokens(f"{tag}-{i}", 96), max_tokens=1)
        out.append((time.perf_counter() - t) * 1000)
    return out


def _big_hint_burst(stub: Any, n: int) -> list[float]:
    """n ApplyHints whose HintApplied events are ~40 KB each; their latencies (ms)."""
    hashes = [i.to_bytes(8, "big") for i in range(4096)]
    out = []
    for i in range(n):
        hint = pb.Hint(hint_id=f"burst-{time.monotonic_ns()}-{i}", selector=pb.Selector(block_hashes=pb.BlockHashSelector(block_hashes=hashes)), evict=pb.EvictAction())
        t = time.perf_counter()
        stub.ApplyHints(pb.ApplyHintsRequest(hints=[hint]), timeout=30)
        out.append((time.perf_counter() - t) * 1000)
    return out


def run_stuck_subscriber(engine: ServedEngine, burst: int, samples: int) -> PhaseResult:
    result = PhaseResult("stuck subscriber")
    counter = EventCounter()
    healthy = EventFollower({ENGINE: engine.grpc_address}, heartbeat=0.5, on_event=counter).start()
    channel = grpc.insecure_channel(engine.grpc_address)
    stub = pbg.KvHintServiceStub(channel)
    client = KvHintClient(engine.grpc_address)
    try:
        if not healthy.wait_synced(30):
            result.fail("the healthy follower did not go live")
        quiet = _latency_ms(engine, "stuck-quiet-1", samples)
        stuck = stub.WatchEvents(pb.WatchEventsRequest(start=pb.WatchEventsRequest.START_NOW), timeout=120)
        time.sleep(0.3)
        publish = _big_hint_burst(stub, burst)
        time.sleep(1.0)  # past the stall threshold
        publish += _big_hint_burst(stub, 5)
        loaded = _latency_ms(engine, "stuck-loaded", samples)
        quiet += _latency_ms(engine, "stuck-quiet-2", samples)
        q, l_ = statistics.median(quiet), statistics.median(loaded)
        result.tried = 2 + len(publish) + len(loaded)
        blocked_ms = ServerConfig().subscriber_stall_s * 1000
        if l_ > q + blocked_ms / 2:
            # An engine that waited on the stuck stream would wait up to the stall threshold per publish.
            result.fail(f"median completion latency {l_:.1f} ms with a stuck subscriber vs {q:.1f} ms without: the engine waits on it")
        elif l_ > 1.3 * q + 2.0:
            result.miss(f"median completion latency {l_:.1f} ms with a stuck subscriber vs {q:.1f} ms without (target 1.3x + 2 ms)")
        messages: list[pb.WatchEventsResponse] = []
        try:
            for m in stuck:
                messages.append(m)
        except grpc.RpcError as err:
            result.fail(f"the stuck stream failed with {err.code().name} instead of ending with a resync")
        final = messages[-1] if messages else None
        cut = final is not None and final.HasField("resync") and final.resync.cause == pb.Resync.CAUSE_SUBSCRIBER_OVERFLOW
        if not cut:
            result.fail("the stuck subscriber was not ended with a SUBSCRIBER_OVERFLOW resync")
        target = latest_sequence(client)
        if not wait_caught_up([healthy], target):
            result.fail("the healthy follower did not catch up")
        result.lost = follower_lost(healthy)
        result.details = {
            "quiet_median_ms": round(q, 1), "loaded_median_ms": round(l_, 1),
            "publish_p50_ms": round(statistics.median(publish), 1), "publish_max_ms": round(max(publish), 1),
            "stuck_messages_before_cut": len(messages) - 1 if cut else len(messages), "overflow_resync": cut,
            "healthy_events_received": counter.messages, "hint_bursts": len(publish),
        }  # fmt: skip
        result.notes = (
            f"completion p50 {l_:.1f} ms stuck vs {q:.1f} ms quiet; ApplyHints p50 {statistics.median(publish):.1f} ms, "
            f"max {max(publish):.0f} ms; stuck one cut by overflow resync: {cut}; healthy follower got {counter.messages} messages"
        )
    finally:
        healthy.stop()
        client.close()
        channel.close()
    return result
