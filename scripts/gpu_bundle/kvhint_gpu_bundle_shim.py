"""A vLLM general plugin for the carried GPU bundle (scripts/gpu_bundle/build.sh), and nothing else.

The bundle carries vLLM 0.32.0's Python code and its main kernel library
(`_C_stable_libtorch`, built on torch's stable ABI, so it loads on the lent machine's torch 2.11)
but not FlashAttention's kernels (`vllm_flash_attn/_vllm_fa2_C` and `_fa3_C`: 480.6 MB uncompressed,
against the device tool's 64 MiB per call) nor FlashInfer. vLLM's CUDA platform ranks
FLASH_ATTN first and does not check that its kernels load, so without this plugin every engine
would pick it and fail at its first forward pass.

`register()` (entry point group `vllm.general_plugins`, which vLLM loads in every process it
starts) therefore drops, on CUDA only and only when FlashAttention's kernels do not import, the
backends whose kernels the bundle lacks from the CUDA platform's ranking. vLLM then chooses among
the rest as it always does: TRITON_ATTN, vLLM's own Triton kernels. It changes nothing else, and
on a machine with `pip install vllm==0.32.0` (FlashAttention present) it does nothing at all.

The plugin is installed only by scripts/gpu_bundle/run.sh, never by `pip install -e .`.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("kvhint.gpu_bundle")

# AttentionBackendEnum names whose kernels the bundle does not carry.
ABSENT_BACKENDS = ("FLASH_ATTN", "FLASHINFER", "TRITON_FLASHINFER", "TRITON_FLASH_ATTN")


def flash_attention_kernels_load() -> bool:
    try:
        from vllm.vllm_flash_attn import flash_attn_interface as fai
    except Exception:  # noqa: BLE001 - any failure means the kernels are not usable
        return False
    return any(fai.is_fa_version_supported(v) for v in (2, 3))


def register() -> None:
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cuda() or flash_attention_kernels_load():
            return
        import vllm.platforms.cuda as cuda
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
    except Exception:  # noqa: BLE001 - not a CUDA vLLM: nothing to do
        return
    if getattr(cuda._get_backend_priorities, "_kvhint_bundle", False):
        return
    absent = {getattr(AttentionBackendEnum, n) for n in ABSENT_BACKENDS if hasattr(AttentionBackendEnum, n)}
    ranked = cuda._get_backend_priorities

    def without_absent_kernels(*args, **kwargs):
        return [b for b in ranked(*args, **kwargs) if b not in absent]

    without_absent_kernels._kvhint_bundle = True  # type: ignore[attr-defined]
    cuda._get_backend_priorities = without_absent_kernels
    logger.warning("kvhint gpu bundle: FlashAttention/FlashInfer kernels not carried; attention backends %s "
                   "left out of vLLM's CUDA ranking", sorted(b.name for b in absent))
