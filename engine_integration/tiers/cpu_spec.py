"""Out-of-tree `OffloadingSpec`s that make vLLM's `OffloadingConnector` run on the CPU backend.

vLLM 0.32's `CPUOffloadingSpec.get_worker` refuses anything but CUDA-alike/XPU
devices ("CPU Offloading is currently only supported on CUDA-alike and XPU
GPUs"): its worker copies with CUDA streams/events and `swap_blocks`. The
scheduler side (`CPUOffloadingManager`: LRU chunk pool, ref counts, events) is
device-neutral. These specs keep that scheduler side unchanged and swap the
worker for a synchronous torch index-copy between the engine's KV tensors and a
host buffer, one engine block per host chunk (`blocks_per_chunk` must be 1).

* `TorchCPUOffloadingSpec`      G2 host tier (private host tensor in the worker).
* `TorchTieringOffloadingSpec`  G2 host tier + secondary tiers (G3 `fs` file
  tier with `root_dir`) via vLLM's `TieringOffloadingManager`. The host buffer
  is the `/dev/shm/vllm_offload_<engine_id>.mmap` region shared by worker and
  scheduler (the `fs` tier threads read/write it on the scheduler side). The
  file is unlinked as soon as both sides have mapped it (in `get_manager`,
  which runs after the worker registered its KV caches), so no exit path -
  clean shutdown, crash, SIGKILL - leaves it behind.

Select one through
    kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "TorchCPUOffloadingSpec",
            "spec_module_path": "engine_integration.tiers.cpu_spec",
            "cpu_bytes_to_use": N}}
or build it with `engine_integration.tiers.config.tier_kv_transfer_config`.
Extra keys understood here: `num_host_blocks` (exact host-tier capacity in
blocks; overrides the count derived from `cpu_bytes_to_use`), and
`kvhint_remove_file_tier_on_shutdown` (tiering spec: delete this model's `fs`
tier directories on clean shutdown; off by default because the file tier is a
persistent cache shared across engines and restarts).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import time

import torch

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingManager,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

__all__ = ["TorchCopyWorker", "TorchCPUOffloadingSpec", "TorchTieringOffloadingSpec"]


class TorchCopyWorker(OffloadingWorker):
    """Synchronous engine-KV <-> host copies; every job is finished on return."""

    def __init__(self, kv_caches: CanonicalKVCaches, host: list[torch.Tensor],
                 region: SharedOffloadRegion | None = None):
        self._dev = [t.tensor for t in kv_caches.tensors]  # (num_blocks, page) int8 views
        self._host = host                                   # (num_chunks, page) int8
        self._group_tensors = [sorted({r.tensor_idx for r in refs})
                               for refs in kv_caches.group_data_refs]
        self._region = region
        self._done: list[TransferResult] = []

    def _copy(self, job_id: int, gpu: GPULoadStoreSpec, host: LoadStoreSpec, store: bool) -> bool:
        assert isinstance(host, CPULoadStoreSpec)
        t0, nbytes, off = time.perf_counter(), 0, 0
        chunks = torch.from_numpy(host.block_ids.astype("int64"))
        blocks = torch.from_numpy(gpu.block_ids.astype("int64"))
        assert len(chunks) == len(blocks), "blocks_per_chunk must be 1"
        for g, n in enumerate(gpu.group_sizes):
            if n == 0:
                continue
            b, c = blocks[off:off + n], chunks[off:off + n]
            for ti in self._group_tensors[g]:
                dev, hst = self._dev[ti], self._host[ti]
                if store:
                    hst.index_copy_(0, c, dev.index_select(0, b))
                else:
                    dev.index_copy_(0, b, hst.index_select(0, c))
                nbytes += n * dev.shape[1]
            off += n
        self._done.append(TransferResult(job_id, True, nbytes, time.perf_counter() - t0))
        return True

    def submit_store(self, job_id, src_spec, dst_spec) -> bool:
        return self._copy(job_id, src_spec, dst_spec, store=True)

    def submit_load(self, job_id, src_spec, dst_spec) -> bool:
        return self._copy(job_id, dst_spec, src_spec, store=False)

    def get_finished(self) -> list[TransferResult]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # synchronous: nothing is ever in flight

    def shutdown(self) -> None:
        self._host = []
        if self._region is not None:
            if not os.path.exists(self._region.mmap_path):
                self._region._creator = False  # name already dropped (see get_manager)
            self._region.cleanup()
            self._region = None


def _apply_host_blocks(spec: CPUOffloadingSpec) -> None:
    assert spec.blocks_per_chunk == 1, "CPU torch-copy specs need blocks_per_chunk == 1"
    if spec.extra_config.get("num_host_blocks"):
        spec.num_chunks = int(spec.extra_config["num_host_blocks"])


class TorchCPUOffloadingSpec(CPUOffloadingSpec):
    """`CPUOffloadingSpec` (same manager, same config keys) with a CPU-backend worker."""

    def __init__(self, config):
        super().__init__(config)
        _apply_host_blocks(self)

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            host = [torch.zeros((self.num_chunks, t.tensor.shape[1]), dtype=torch.int8)
                    for t in kv_caches.tensors]
            self._worker = TorchCopyWorker(kv_caches, host)
        return self._worker


class TorchTieringOffloadingSpec(TieringOffloadingSpec):
    """`TieringOffloadingSpec` (CPU primary + `secondary_tiers`) with a CPU-backend worker."""

    def __init__(self, config):
        super().__init__(config)
        _apply_host_blocks(self)

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            region = SharedOffloadRegion(
                engine_id=self._engine_id, num_chunks=self.num_chunks, rank=0,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker)
            try:
                host = [region.create_next_worker_view(t.tensor.shape[1]) for t in kv_caches.tensors]
            except Exception:
                region.cleanup()
                raise
            self._worker = TorchCopyWorker(kv_caches, host, region)
        return self._worker

    def get_manager(self) -> OffloadingManager:
        fresh = self._manager is None
        manager = super().get_manager()
        mm = self._scheduler_mmap
        if fresh and mm is not None and not mm._creator:
            # The worker created and mapped the region (EngineCore registers KV
            # caches before it builds the scheduler); both sides hold mappings,
            # so drop the name now: nothing can leak it afterwards.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(mm.mmap_path)
        if fresh and self.extra_config.get("kvhint_remove_file_tier_on_shutdown"):
            orig_shutdown = manager.shutdown

            def shutdown() -> None:
                orig_shutdown()
                for tier in getattr(manager, "secondary_tiers", ()):
                    base = getattr(getattr(tier, "file_mapper", None), "base_path", None)
                    for path in glob.glob(glob.escape(base) + "*") if base else ():
                        shutil.rmtree(path, ignore_errors=True)  # <model>_<digest>, <model>_<digest>_r<rank>

            manager.shutdown = shutdown
        return manager
