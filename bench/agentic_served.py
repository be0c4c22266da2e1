"""The engine the agentic benchmark replays against (`bench.agentic_engine`):
one it starts (`start_engine`, a served ``vllm serve``) or a running one
(`EngineHandle` with no ``served``), its capabilities and its scheduling priority.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.trace import Trace


@dataclass
class EngineHandle:
    """An engine to replay against: one we started (`served`) or an existing one."""

    http_url: str
    grpc_address: str
    served: Any = None  # engine_integration.served.ServedEngine
    model: str = ""

    def reset_cache(self) -> None:
        """Empty the device prefix cache and the connector's tiers (a no-op without a
        connector), so the next run never starts warm."""
        from engine_integration.served import reset_prefix_cache

        reset_prefix_cache(self.http_url, external=True)

    def stop(self) -> None:
        if self.served is not None:
            self.served.stop()


def start_engine(
    model: str, trace: Trace, *, log_path: str | Path | None = None, extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None, max_num_seqs: int = 16,
) -> EngineHandle:
    from engine_integration.served import EngineSpec, ServedEngine

    h = trace.header
    spec = EngineSpec(
        model=model,
        block_size=h.block_size,
        num_gpu_blocks=h.num_gpu_blocks,
        max_model_len=h.max_model_len,
        max_num_seqs=max_num_seqs,
        extra_args=list(extra_args),
        env={"VLLM_SERVER_DEV_MODE": "1", **(env or {})},
    )
    served = ServedEngine(spec, log_path=log_path)
    served.start()
    return EngineHandle(served.http_url, served.grpc_address, served, model)


def set_nice(engine: EngineHandle, nice: int, say: Callable[[str], None]) -> None:
    """Renice the engine's process group and this process (ours only)."""
    try:
        if engine.served is not None and engine.served.proc is not None:
            os.setpriority(os.PRIO_PGRP, engine.served.proc.pid, nice)
        os.setpriority(os.PRIO_PROCESS, 0, nice)
        say(f"engine and client reniced to {nice}")
    except (OSError, AttributeError) as err:
        say(f"could not renice to {nice}: {err}")


def engine_capabilities(engine: EngineHandle) -> dict[str, Any]:
    from kvhint_client import KvHintClient

    with KvHintClient(engine.grpc_address) as kv:
        c = kv.capabilities(timeout=30)
    return {
        "engine": f"{c.engine} {c.engine_version}",
        "num_device_blocks": c.num_device_blocks,
        "block_size": c.block_size,
        "pin_budget_blocks": c.limits.pin_budget_blocks,
        "pin_budget_fraction": c.limits.pin_budget_fraction,
        "block_hash_encoding": c.block_hash_encoding,
        "tiers": [t.medium for t in c.tiers],
    }

