"""The LRU simulator against vLLM's own KVCacheManager / BlockPool.

Drives the real vllm.v1.core.kv_cache_manager.KVCacheManager with the call
sequence of vLLM's synchronous scheduler for one request at a time (the CPU
platform forces async_scheduling off): get_computed_blocks, allocate_slots for
the prefill, then one allocate_slots per decode step after each sampled token
is appended, free on finish. vLLM hashes with its own hasher; only the cached
token counts are compared. Skipped when vLLM is not installed.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from bench.generate import PRESETS, generate_trace
from bench.simulate import compile_trace, simulate_lru
from bench_strategies import tiny_traces

vllm_mgr = pytest.importorskip("vllm.v1.core.kv_cache_manager")


def vllm_cached_tokens(trace) -> list[int]:
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request as VRequest

    h = trace.header
    bs = h.block_size
    fn = get_hash_fn_by_name("sha256")
    init_none_hash(fn)
    hasher = get_request_block_hasher(bs, fn)
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=8, dtype=torch.float32)
    cfg = KVCacheConfig(num_blocks=h.num_gpu_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    mgr = vllm_mgr.KVCacheManager(
        cfg, max_model_len=h.max_model_len, scheduler_block_size=bs, hash_block_size=bs, enable_caching=True
    )
    out = []
    for r in trace.requests():
        ids = trace.expand_prompt(r)
        gen = trace.output_placeholder(r).tolist()
        req = VRequest(r.request_id, ids, SamplingParams(max_tokens=r.max_tokens), None, block_hasher=hasher)
        blocks, nhit, _ = mgr.get_computed_blocks(req)
        assert mgr.allocate_slots(req, len(ids) - nhit, nhit, blocks) is not None
        req.num_computed_tokens = len(ids)
        for k in range(r.max_tokens):
            req.append_output_token_ids(gen[k])
            if k == r.max_tokens - 1:
                break  # the last sampled token is never fed back
            assert mgr.allocate_slots(req, 1) is not None
            req.num_computed_tokens += 1
        mgr.free(req)
        out.append(nhit)
    return out


@pytest.mark.parametrize("preset", ["fast", "default"])
def test_lru_sim_equals_vllm_block_pool_on_presets(preset):
    tr = generate_trace(PRESETS[preset], 0)
    assert simulate_lru(compile_trace(tr)).cached_tokens == vllm_cached_tokens(tr)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tiny_traces(with_signals=False))
def test_lru_sim_equals_vllm_block_pool_random(tr):
    assert simulate_lru(compile_trace(tr)).cached_tokens == vllm_cached_tokens(tr)
