"""The conformance plan's pool arithmetic (no engine): sessions and pressure sized from
GetCapabilities, including hybrid models whose prefills take blocks in every KV-cache group."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from conformance.target import Options, group_footprint, make_plan
from kvhint.v1 import kvhint_pb2 as pb

OPTIONS = Options(target="127.0.0.1:1", openai_url="http://127.0.0.1:1")
G = pb.KvCacheGroup


def caps(blocks: int, bs: int = 32, budget: int = 39, window: int | None = None) -> pb.GetCapabilitiesResponse:
    c = pb.GetCapabilitiesResponse(block_size=bs, num_device_blocks=blocks)
    c.limits.pin_budget_blocks = budget
    if window is not None:
        c.kv_cache_groups.add(group_id=0, kind=G.KIND_FULL_ATTENTION, block_size=bs, defines_residency=True)
        c.kv_cache_groups.add(group_id=1, kind=G.KIND_SLIDING_WINDOW, block_size=bs, sliding_window_tokens=window)
    return c


def test_reference_setups() -> None:
    dense, hybrid = make_plan(caps(80), OPTIONS), make_plan(caps(80, window=128), OPTIONS)
    assert (dense.session_blocks, dense.overflow_filler(3)) == (25, 17)
    # 17 full blocks + 4 window-tail blocks cached per session; a 18-block prefill takes 36.
    assert group_footprint(caps(80, window=128))(17) == (21, 34)
    assert (hybrid.session_blocks, hybrid.overflow_filler(3)) == (17, 14)


def test_a_single_group_listed_is_the_dense_arithmetic() -> None:
    one = caps(80)
    one.kv_cache_groups.add(group_id=0, kind=G.KIND_FULL_ATTENTION, block_size=32, defines_residency=True)
    assert make_plan(one, OPTIONS).session_blocks == make_plan(caps(80), OPTIONS).session_blocks


@given(blocks=st.integers(16, 4000), window=st.sampled_from([None, 64, 128, 512]), budget=st.integers(2, 2000))
def test_three_sessions_fit_while_the_third_is_prefilled(blocks: int, window: int | None, budget: int) -> None:
    c = caps(blocks, budget=min(budget, blocks), window=window)
    plan = make_plan(c, Options(target="x", openai_url="y", max_model_len=1 << 20))
    if not plan.pressure_ok and plan.session_blocks == 2:
        return  # too small a pool: the plan says so instead of sizing
    n = plan.session_blocks
    cached, _ = plan.footprint(n)
    prefill = plan.footprint(n + 1)[1]
    assert 2 * cached + prefill <= blocks and 3 * cached < blocks and n <= c.limits.pin_budget_blocks
    # One larger session would break one of those bounds (or the budget).
    bigger = plan.footprint(n + 1)[0]
    assert n + 1 > c.limits.pin_budget_blocks or 3 * bigger + 4 > blocks or 2 * bigger + plan.footprint(n + 2)[1] + 2 > blocks
    # The filler overflows the free blocks by about half a session, no more.
    filler = plan.overflow_filler(3)
    free = blocks - 1 - 3 * cached
    assert plan.footprint(filler)[1] >= free + math.ceil(cached / 2)
    assert filler == 1 or plan.footprint(filler - 1)[1] < free + math.ceil(cached / 2)


def gemma3_caps(blocks: int = 240, window: int = 96) -> pb.GetCapabilitiesResponse:
    """The hybrid6 preset's layout: five sliding-window groups and one full-attention group."""
    c = pb.GetCapabilitiesResponse(block_size=32, num_device_blocks=blocks)
    c.limits.pin_budget_blocks = (blocks - 1) // 2
    for gid in range(5):
        c.kv_cache_groups.add(group_id=gid, kind=G.KIND_SLIDING_WINDOW, block_size=32, sliding_window_tokens=window)
    c.kv_cache_groups.add(group_id=5, kind=G.KIND_FULL_ATTENTION, block_size=32, defines_residency=True)
    return c


def test_window_tail_is_the_shortest_cached_window_tail() -> None:
    assert make_plan(caps(80), OPTIONS).window_tail == 0
    assert make_plan(caps(80, window=128), OPTIONS).window_tail == 4  # ceil(127 / 32)
    assert make_plan(gemma3_caps(), OPTIONS).window_tail == 3  # ceil(95 / 32)
    assert make_plan(caps(80, window=33), OPTIONS).window_tail == 1
    mixed = gemma3_caps()
    mixed.kv_cache_groups[0].sliding_window_tokens = 40
    assert make_plan(mixed, OPTIONS).window_tail == 2


def test_sessions_cached_together_count_every_group() -> None:
    """The pin-budget cases keep budget // session + 1 sessions cached at once. Dense and the
    two-group hybrid at 80 blocks can; six groups at 240 blocks cannot (the cases skip there)."""
    dense, hybrid, six = (make_plan(c, OPTIONS) for c in (caps(80), caps(80, window=128), gemma3_caps()))
    assert dense.cached_together(2) == 25 + 26 <= 78
    assert hybrid.cached_together(3) == 2 * (17 + 4) + 2 * 18 <= 78
    assert six.session_blocks == 25 and six.footprint(25) == (25 + 5 * 3, 25 * 6)
    assert six.cached_together(5) == 4 * 40 + 26 * 6 > 238


def window_only(blocks: int = 80, window: int = 128, bs: int = 32) -> pb.GetCapabilitiesResponse:
    """A model whose every layer slides: one sliding-window group, which defines residency."""
    c = caps(blocks, bs=bs)
    c.kv_cache_groups.add(group_id=0, kind=G.KIND_SLIDING_WINDOW, block_size=bs, sliding_window_tokens=window,
                          defines_residency=True)
    return c


def test_a_sliding_window_only_engine_keeps_a_window_tail_of_each_prompt() -> None:
    plan = make_plan(window_only(), OPTIONS)
    # The served `window` preset (bench/results/conformance_window.md): a 31-block session prompt
    # keeps ceil(127 / 32) = 4 blocks, and a 5-block prompt keeps 4 of its 5.
    assert plan.session_blocks == 31 and plan.resident_tail == 4
    assert (plan.session_resident, plan.resident_blocks(5), plan.resident_blocks(3)) == (4, 4, 3)
    # Pressure counts the blocks a cached prompt keeps: 80 + 4 over 4 per prompt, plus one.
    assert plan.filler_count == 22 and plan.pressure_ok
    assert "4 of them resident" in plan.summary()


def test_every_prompt_block_is_resident_when_any_residency_group_is_full_attention() -> None:
    for c in (caps(80), caps(80, window=128)):
        plan = make_plan(c, OPTIONS)
        assert plan.resident_tail == 0 and plan.session_resident == plan.session_blocks
        assert plan.filler_count == math.ceil((80 + plan.session_blocks) / plan.session_blocks) + 1
    # Groups that do not say which defines residency all do (the proto's rule): a full-attention one among them.
    unflagged = caps(80)
    unflagged.kv_cache_groups.add(group_id=0, kind=G.KIND_FULL_ATTENTION, block_size=32)
    unflagged.kv_cache_groups.add(group_id=1, kind=G.KIND_SLIDING_WINDOW, block_size=32, sliding_window_tokens=128)
    assert make_plan(unflagged, OPTIONS).resident_tail == 0
    # Two window groups defining residency: the shorter tail bounds what stays resident.
    two = window_only(window=128)
    two.kv_cache_groups.add(group_id=1, kind=G.KIND_SLIDING_WINDOW, block_size=32, sliding_window_tokens=64,
                            defines_residency=True)
    assert make_plan(two, OPTIONS).resident_tail == 2


@given(blocks=st.integers(16, 4000), window=st.sampled_from([None, 64, 128, 512]))
def test_pressure_never_shrinks_for_layouts_that_keep_whole_prompts(blocks: int, window: int | None) -> None:
    plan = make_plan(caps(blocks, window=window), OPTIONS)
    n = plan.session_blocks
    assert plan.filler_count == math.ceil((plan.capacity_blocks + n) / n) + 1
