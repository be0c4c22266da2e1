"""`kvhint demo`: two agents under cache pressure, with and without a Pin.

Starts `vllm serve` (CPU) on the generated tiny model with the KvHint sidecar
and a small block pool (80 blocks of 32 tokens), then runs one scenario twice:

  agent A   turn 1: a long context (system prompt + task), then a tool call
            (the agent pauses)
  agent B   four turns with large tool outputs while A waits (cache pressure)
  agent A   turn 2: resumes with the tool result appended

Variant "no-hint" leaves vLLM's LRU alone; variant "pin" pins A's session via
ApplyHints when A starts its tool call and releases it when A finishes. The
table shows the cached (reused) prompt tokens and the client-side TTFT of
every turn.
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass

from kvhint_client.openai_traffic import complete

SYSTEM_TOKENS = 96  # shared system + tool prefix (3 blocks)
TASK_TOKENS = 608  # agent A's private context
TOOL_RESULT_TOKENS = 96
B_TURN_TOKENS = 704


@dataclass
class Turn:
    variant: str
    agent: str
    turn: str
    prompt_tokens: int
    cached_tokens: int
    ttft_ms: float

    @property
    def hit(self) -> str:
        return "hit" if self.cached_tokens >= self.prompt_tokens // 2 else ("partial" if self.cached_tokens else "miss")


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(3, 4000) for _ in range(n)]


def run_variant(http_url: str, grpc_address: str, variant: str, seed: int) -> list[Turn]:
    from kvhint_client import KvHintClient, session

    rng = random.Random(seed)
    system = _tokens(random.Random(7), SYSTEM_TOKENS)  # the same in both variants
    a_session, b_session = f"agent-a-{variant}", f"agent-b-{variant}"
    a_context = system + _tokens(rng, TASK_TOKENS)
    turns: list[Turn] = []

    def record(agent: str, turn: str, prompt: list[int], session_id: str) -> None:
        c = complete(http_url, prompt, session_id=session_id, continuation_id=f"{session_id}/{turn}", max_tokens=1)
        turns.append(Turn(variant, agent, turn, c.prompt_tokens, c.cached_tokens, c.ttft_s * 1000))

    with KvHintClient(grpc_address) as kvhint:
        record("A", "1", a_context, a_session)
        if variant == "pin":
            result = kvhint.apply(session(a_session).pin(ttl=30, hint_id=f"{a_session}-tool-call"))[0]
            print(
                f"  [{variant}] A starts a tool call -> Pin(session={a_session}, ttl=30s): "
                f"{pb_outcome(result.outcome)}, {sum(c.blocks for c in result.affected_blocks)} blocks",
                flush=True,
            )
        for i in range(4):
            record("B", f"{i + 1}", system + _tokens(rng, B_TURN_TOKENS - SYSTEM_TOKENS), b_session)
        record("A", "2", a_context + _tokens(rng, TOOL_RESULT_TOKENS), a_session)
        if variant == "pin":
            kvhint.apply(session(a_session).release())  # A finished: its blocks go first
    return turns


def pb_outcome(outcome: int) -> str:
    from kvhint.v1 import kvhint_pb2 as pb

    return pb.Outcome.Name(outcome).removeprefix("OUTCOME_")


def print_table(turns: list[Turn]) -> None:
    print(f"\n{'variant':<8} {'agent':<5} {'turn':<4} {'prompt':>6} {'cached':>6} {'result':<7} {'ttft_ms':>8}")
    for t in turns:
        print(f"{t.variant:<8} {t.agent:<5} {t.turn:<4} {t.prompt_tokens:>6} {t.cached_tokens:>6} {t.hit:<7} {t.ttft_ms:>8.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvhint demo", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: generate the tiny model)")
    parser.add_argument("--log", help="engine log file (default: a temp file)")
    args = parser.parse_args(argv)

    from .served import EngineSpec, ServedEngine, default_model

    model = args.model or default_model("tiny")
    print(f"KvHint demo: vllm serve on {model} (CPU), 80 blocks x 32 tokens, KvHint sidecar on gRPC", flush=True)
    engine = ServedEngine(EngineSpec(model=model), log_path=args.log)
    print(f"  starting engine (log: {engine.log_path}) ...", flush=True)
    with engine:
        print(f"  engine ready: OpenAI API {engine.http_url}, KvHint gRPC {engine.grpc_address}", flush=True)
        turns = run_variant(engine.http_url, engine.grpc_address, "no-hint", seed=1)
        turns += run_variant(engine.http_url, engine.grpc_address, "pin", seed=2)
    print_table(turns)
    resume = {t.variant: t for t in turns if t.agent == "A" and t.turn == "2"}
    base, pinned = resume["no-hint"], resume["pin"]
    print(
        f"\nAgent A's resume after its tool call: without a hint it reused {base.cached_tokens} of "
        f"{base.prompt_tokens} prompt tokens (TTFT {base.ttft_ms:.1f} ms); with a Pin it reused "
        f"{pinned.cached_tokens} of {pinned.prompt_tokens} (TTFT {pinned.ttft_ms:.1f} ms)."
    )
    return 0 if pinned.cached_tokens > base.cached_tokens else 1


if __name__ == "__main__":
    sys.exit(main())
