"""Campaign phases 3 and 5: kill and restart, and bad configuration.

Phase 3: SIGKILL the engine's whole process group (API server, EngineCore,
workers: nothing shuts down cleanly), relaunch on the same ports, and time
from the new sidecar first answering (a fresh channel sees the new epoch) to
a long-lived KvHintClient and a long-lived EventFollower reaching it (target
2 s each). Then `resumes` subscribers resume from the old (epoch, sequence):
each must get Resync CAUSE_EPOCH_CHANGED naming the new epoch at once. The
follower must hold the new epoch's sessions and none of the old.

Phase 5: `kvhint-vllm serve` (engine_integration.launcher) with one bad
KVHINT_* value at a time must exit non-zero within a few seconds, before a
model loads, and name the variable on stderr.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Optional

import grpc

from engine_integration.served import ServedEngine
from kvhint.v1 import kvhint_pb2 as pb
from kvhint.v1 import kvhint_pb2_grpc as pbg
from kvhint_client import KvHintClient
from kvhint_client.errors import KvHintError
from kvhint_client.follower import EventFollower
from kvhint_client.openai_traffic import complete

from .campaign_model import PhaseResult, latest_sequence, start_engine, tokens

RECOVERY_TARGET_S = 2.0
ENGINE = "e"


def _fresh_epoch(address: str) -> Optional[str]:
    with grpc.insecure_channel(address) as channel:
        try:
            return str(pbg.KvHintServiceStub(channel).GetCapabilities(pb.GetCapabilitiesRequest(), timeout=0.2).epoch)
        except grpc.RpcError:
            return None


def first_new_epoch(probes: dict[str, Callable[[], Optional[str]]], old: str, stop: threading.Event) -> dict[str, float]:
    """Poll each probe on its own thread every 20 ms; the monotonic time each first
    returned an epoch other than `old` (filled in as they arrive)."""
    seen: dict[str, float] = {}

    def poll(name: str, probe: Callable[[], Optional[str]]) -> None:
        while not stop.is_set():
            epoch = probe()
            if epoch and epoch != old:
                seen[name] = time.monotonic()
                return
            stop.wait(0.02)

    for item in probes.items():
        threading.Thread(target=poll, args=item, daemon=True).start()
    return seen


def caught_up(position: Optional[tuple[str, int]], epoch: str, sequence: int) -> bool:
    return position is not None and position[0] == epoch and position[1] >= sequence


def sigkill_group(engine: ServedEngine) -> None:
    assert engine.proc is not None
    os.killpg(engine.proc.pid, signal.SIGKILL)
    engine.proc.wait(30)
    engine.stop()  # reaps what is left of the group


def _resume_cause(address: str, epoch: str, sequence: int) -> tuple[int, str]:
    request = pb.WatchEventsRequest(start=pb.WatchEventsRequest.START_RESUME, resume_epoch=epoch, resume_after_sequence=sequence)
    with grpc.insecure_channel(address) as channel:
        try:
            first = next(iter(pbg.KvHintServiceStub(channel).WatchEvents(request, timeout=10)))
        except (grpc.RpcError, StopIteration) as exc:
            return -1, repr(exc)[:200]
    return (first.resync.cause, first.resync.current_epoch) if first.HasField("resync") else (-1, "no resync")


def run_restart(engine: ServedEngine, resumes: int) -> tuple[PhaseResult, ServedEngine]:
    """Returns the phase result and the relaunched engine (the old one is gone)."""
    result = PhaseResult("kill -9 and restart")
    follower = EventFollower({ENGINE: engine.grpc_address}, heartbeat=0.2).start()
    client = KvHintClient(engine.grpc_address)
    restarted = engine
    stop = threading.Event()
    try:
        if not follower.wait_synced(30):
            result.fail("the follower did not go live before the kill")
        complete(engine.http_url, tokens("before-kill", 96), session_id="before-kill")
        old_epoch = client.capabilities().epoch
        old_seq = latest_sequence(client)

        def client_epoch() -> Optional[str]:
            try:
                return client.capabilities(timeout=0.5).epoch
            except KvHintError:
                return None

        def follower_epoch() -> Optional[str]:
            position = follower.position(ENGINE)
            return position[0] if position and follower.index.is_live(ENGINE) else None

        t_kill = time.monotonic()
        sigkill_group(engine)
        seen = first_new_epoch(
            {"serving": lambda: _fresh_epoch(engine.grpc_address), "client": client_epoch, "follower": follower_epoch}, old_epoch, stop
        )
        restarted = start_engine(engine.http_port, engine.grpc_port)
        t_healthy = time.monotonic()
        deadline = time.monotonic() + 30
        while len(seen) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        delays = {name: round(seen[name] - seen["serving"], 3) if name in seen and "serving" in seen else None for name in ("client", "follower")}
        result.tried += 2
        for name, delay in delays.items():
            if delay is None:
                result.fail(f"{name} did not reach the new epoch within 30 s of the relaunch")
            elif delay > RECOVERY_TARGET_S:
                result.miss(f"{name} reached the new epoch {delay} s after SERVING (target {RECOVERY_TARGET_S} s)")
        new_epoch = client.capabilities(timeout=10).epoch
        for _ in range(resumes):
            result.tried += 1
            cause, epoch = _resume_cause(restarted.grpc_address, old_epoch, old_seq)
            if cause != pb.Resync.CAUSE_EPOCH_CHANGED or epoch != new_epoch:
                result.fail(f"resume from the old epoch got cause {cause} ({epoch})")
        complete(restarted.http_url, tokens("after-kill", 96), session_id="after-kill")
        target = latest_sequence(client)
        t_end = time.monotonic() + 30
        while time.monotonic() < t_end and not caught_up(follower.position(ENGINE), new_epoch, target):
            time.sleep(0.05)
        held = follower.index.sessions(ENGINE)
        result.tried += 1
        if "before-kill" in held or "after-kill" not in held:
            result.fail(f"the follower holds {sorted(held)[:5]} after the restart (wanted after-kill only)")
        result.details = {
            "relaunch_to_healthy_s": round(t_healthy - t_kill, 1), "recovery_after_serving_s": delays,
            "resumes": resumes, "epoch_changed": old_epoch != new_epoch,
        }  # fmt: skip
        result.notes = (
            f"SIGKILL of the process group, relaunch healthy after {t_healthy - t_kill:.0f} s; after SERVING the client "
            f"saw the new epoch in {delays['client']} s, the follower in {delays['follower']} s (target {RECOVERY_TARGET_S} s); "
            f"{resumes} resumes from the old epoch"
        )
    finally:
        stop.set()
        follower.stop()
        client.close()
    return result, restarted


# (variable, value, extra variables): each must make `serve` exit non-zero naming the variable.
BAD_CONFIGS: list[tuple[str, str, dict[str, str]]] = [
    ("KVHINT_MAX_TTL_S", "nan", {}),
    ("KVHINT_MAX_TTL_S", "inf", {}),
    ("KVHINT_MAX_TTL_S", "-5", {}),
    ("KVHINT_PIN_BUDGET_FRACTION", "1.5", {}),
    ("KVHINT_SUBSCRIBER_STALL_S", "abc", {}),
    ("KVHINT_MAX_PAGE_SIZE", "0", {}),
    ("KVHINT_EVENT_REPLAY_WINDOW", "-1", {}),
    ("KVHINT_HEARTBEAT_INTERVAL_S", "nan", {}),
    ("KVHINT_AUTH_TOKEN", "has space", {}),
    ("KVHINT_ALLOW_INSECURE_REMOTE", "maybe", {}),
    ("KVHINT_TLS_CERT_FILE", "{pem}", {}),  # without the key
    ("KVHINT_TLS_KEY_FILE", "/nonexistent/key.pem", {"KVHINT_TLS_CERT_FILE": "{pem}"}),
    ("KVHINT_GRPC_ADDRESS", "0.0.0.0:{port}", {}),  # no token, no TLS
    ("KVHINT_GRPC_ADDRESS", "127.0.0.1:99999", {}),
]


def run_bad_config(engine: ServedEngine, within_s: float = 15.0) -> PhaseResult:
    """`engine` gives the command line (model, ports); it is not started here."""
    result = PhaseResult("bad configuration")
    times = []
    with tempfile.NamedTemporaryFile("w", suffix=".pem") as pem:
        pem.write("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
        pem.flush()
        for name, value, extra in BAD_CONFIGS:
            fill = {"pem": pem.name, "port": str(engine.grpc_port)}
            env = {k: v for k, v in os.environ.items() if not k.startswith("KVHINT_")}
            env.update({k: v.format(**fill) for k, v in extra.items()})
            env[name] = value.format(**fill)
            t0 = time.monotonic()
            result.tried += 1
            proc = subprocess.Popen(engine.command(), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
            try:
                _, stderr = proc.communicate(timeout=within_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # it started serving: take the whole group down
                proc.communicate()
                result.fail(f"{name}={value}: still running after {within_s:.0f} s")
                continue
            times.append(time.monotonic() - t0)
            if proc.returncode == 0 or name not in stderr:
                result.fail(f"{name}={value}: exit {proc.returncode}, stderr tail {stderr[-200:]!r}")
    result.details = {"cases": [f"{n}={v}" for n, v, _ in BAD_CONFIGS], "exit_s_max": round(max(times, default=0), 1)}
    result.notes = f"{len(BAD_CONFIGS)} bad KVHINT_* settings; slowest exit {max(times, default=0):.1f} s, before any model load"
    return result
