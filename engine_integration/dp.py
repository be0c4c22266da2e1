"""Data-parallel rank and size of the EngineCore a KvHint sidecar runs in.

vLLM's `--data-parallel-size N` starts N EngineCore processes, each with its own scheduler,
KV-cache pool and (with KvHintScheduler) its own KvHint server. For dense (non-MoE) models
vLLM makes each rank independent and rewrites its ParallelConfig to look like DP=1
(`reconfigure_for_independent_dp_rank`: data_parallel_rank 0, data_parallel_size 1); the
original rank survives in `data_parallel_index`, and the original size in
`elastic_ep_max_dp_size` (equal to the configured size unless elastic EP is on). MoE ranks
keep `data_parallel_rank` / `data_parallel_size`.
"""

from __future__ import annotations

from typing import Any


def dp_rank_and_size(vllm_config: Any) -> tuple[int, int]:
    """(rank, size) of this EngineCore in its data-parallel group; (0, 1) without DP."""
    parallel = vllm_config.parallel_config
    rank = getattr(parallel, "data_parallel_index", None)
    if rank is None:
        rank = getattr(parallel, "data_parallel_rank", 0)
    rank = int(rank or 0)
    size = int(getattr(parallel, "data_parallel_size", 1) or 1)
    if size == 1 and not getattr(parallel, "enable_elastic_ep", False):
        size = int(getattr(parallel, "elastic_ep_max_dp_size", 1) or 1)
    return rank, max(size, rank + 1)


def rank_address(address: str, rank: int) -> str:
    """`address` for data-parallel rank `rank`: HOST:(PORT + rank), port 0 kept; `unix:PATH.rank`."""
    if address.startswith(("unix:", "unix-abstract:")):
        return f"{address}.{rank}"
    host, _, port = address.rpartition(":")
    return f"{host}:{int(port) + rank}" if host and port.isdigit() and int(port) else address


def free_base_port(ranks: int) -> int:
    """A loopback port p with p .. p + ranks - 1 all free: the sidecar ports of a DP group
    whose KVHINT_GRPC_ADDRESS is p (rank r listens on p + r)."""
    import socket

    from .served import free_port

    for _ in range(100):
        port = free_port()
        free = True
        for offset in range(1, ranks):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + offset))
                except OSError:
                    free = False
                    break
        if free:
            return port
    raise RuntimeError(f"no {ranks} consecutive free loopback ports")
