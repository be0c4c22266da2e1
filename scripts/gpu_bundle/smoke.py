"""The GPU bundle's smoke check: `scripts/gpu_bundle/run.sh check` runs it before
scripts/gpu_check.sh, and runs the full check only when it passes.

For each generated model, one offline vLLM engine with KvHint's scheduler and the served engines'
settings (engine_integration.served.EngineSpec: blocks, model length, sequences, memory share,
seed), eager, which then generates four tokens for one prompt. It prints the scheduling mode vLLM chose and `smoke: MODEL ok`.

Why: on the lent H200 each of gpu_check's steps starts its own engines, so an engine that cannot
start fails every step in turn. The second bundle run there spent 309 s of a 15-minute lease on
such failures (bench/results/gpu_check_h200/bundle_run2/). This check fails in well under a
minute and leaves the lease time for a fix.

Usage: python3 scripts/gpu_bundle/smoke.py [--models dense,hybrid]
Exit status 0 when every engine generated its tokens, 1 when one did not (its traceback on stderr).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PRESETS = {"dense": "tiny", "hybrid": "hybrid"}  # scripts/gpu_check.py's MODELS
# Each engine's sidecar on a free port (the first engine's may still hold the default one while
# the next starts), as bench/step_overhead.py does.
os.environ.setdefault("KVHINT_GRPC_ADDRESS", "127.0.0.1:0")


def smoke(preset: str) -> dict[str, object]:
    """One engine on the generated `preset`: four tokens for one prompt."""
    from vllm import LLM, SamplingParams

    from engine_integration.served import SCHEDULER_CLS, EngineSpec, default_model

    spec = EngineSpec(model=default_model(preset))
    t = time.monotonic()
    llm = LLM(
        spec.model,
        scheduler_cls=SCHEDULER_CLS,
        block_size=spec.block_size,
        num_gpu_blocks_override=spec.num_gpu_blocks,
        max_model_len=spec.max_model_len,
        max_num_seqs=spec.max_num_seqs,
        enforce_eager=True,
        gpu_memory_utilization=spec.gpu_memory_utilization,
        enable_prefix_caching=True,
        seed=spec.seed,
    )
    started = time.monotonic() - t
    [out] = llm.generate([{"prompt_token_ids": list(range(1, 97))}], SamplingParams(max_tokens=4, temperature=0.0),
                         use_tqdm=False)
    tokens = list(out.outputs[0].token_ids)
    if len(tokens) != 4:
        raise RuntimeError(f"{preset}: generated {len(tokens)} tokens, expected 4")
    sched = llm.llm_engine.vllm_config.scheduler_config
    result = {"start_s": round(started, 1), "async_scheduling": bool(sched.async_scheduling), "tokens": tokens}
    llm.llm_engine.engine_core.shutdown()  # its memory and sidecar freed before the next model's engine
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="dense,hybrid", help="comma-separated subset of: dense, hybrid")
    args = ap.parse_args(argv)
    names = args.models.split(",")
    if not set(names) <= set(PRESETS):
        ap.error(f"--models: a comma-separated subset of {', '.join(PRESETS)}")
    ok = True
    for name in names:
        try:
            result = smoke(PRESETS[name])
        except Exception:  # noqa: BLE001 - reported, and the next model still runs
            traceback.print_exc()
            print(f"smoke: {name} FAILED", flush=True)
            ok = False
            continue
        print(f"smoke: {name} ok: {result}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
