"""A held-out hybrid layout: the `hybrid6` preset (Gemma 3: five sliding-window KV-cache groups of
96 tokens and one full-attention group sharing a 240-block pool of 32 tokens). The integration
was written against Gemma 2's two groups; these run the user-visible checks on six, with a window
that covers three blocks instead of four.

The retention and event tests are the ones the dense and the Gemma 2 engines run (called here on
this engine); the pressure they apply is enough for six groups at 240 blocks (a 720-token
prefill takes 23 blocks in each of the six groups). The identity check against stock vLLM on the
same model and pool, and the conformance suite, run on it too."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import test_engine_events as events_tests
import test_engine_identity as identity_tests
import test_engine_retention as retention_tests
from engine_pool import EnginePool, uses
from engine_support import Engine, conformance_passes, start_engine, stop_engine
from shared_engines import POOL

from engine_integration.served import default_model, pool_blocks
from kvhint.v1 import kvhint_pb2 as pb

pytestmark = pytest.mark.engine

BLOCKS = pool_blocks("hybrid6")  # 240

POOL.register("hybrid6", lambda: start_engine(default_model("hybrid6"), zmq=True, num_gpu_blocks=BLOCKS),
              stop_engine, uses("hybrid6"))
POOL.register("stock6", lambda: start_engine(default_model("hybrid6"), kvhint=False, zmq=True, num_gpu_blocks=BLOCKS),
              stop_engine, uses("stock6"))


@pytest.fixture(scope="module")
def hybrid6(engine_pool: EnginePool) -> Iterator[Engine]:
    with engine_pool.engine("hybrid6") as eng:
        yield eng


@pytest.fixture(scope="module")
def stock6(engine_pool: EnginePool) -> Iterator[Engine]:
    with engine_pool.engine("stock6") as eng:
        yield eng


@pytest.fixture
def clean6(hybrid6: Engine) -> Engine:
    hybrid6.reset_cache()
    return hybrid6


def test_capabilities_list_five_window_groups_and_one_full_group(hybrid6: Engine) -> None:
    caps = hybrid6.stub.GetCapabilities(pb.GetCapabilitiesRequest())
    kinds = sorted((g.kind, g.sliding_window_tokens, g.defines_residency, g.block_size) for g in caps.kv_cache_groups)
    assert kinds == [(pb.KvCacheGroup.KIND_FULL_ATTENTION, 0, True, 32)] + [(pb.KvCacheGroup.KIND_SLIDING_WINDOW, 96, False, 32)] * 5
    assert caps.num_device_blocks == BLOCKS


def test_issue_scenario_pinned_session_keeps_its_prefix_hit(clean6: Engine) -> None:
    retention_tests.test_pinned_session_keeps_its_prefix_hit_after_unrelated_prompts(clean6)


def test_pinned_session_survives_pressure_that_evicts_an_unhinted_one(clean6: Engine) -> None:
    retention_tests.test_pinned_session_survives_pressure_that_evicts_an_unhinted_one(clean6)


def test_retained_session_survives_pressure(clean6: Engine) -> None:
    retention_tests.test_retained_session_survives_pressure(clean6)


def test_evict_frees_a_session_now(clean6: Engine) -> None:
    retention_tests.test_evict_frees_a_session_now(clean6)


def test_stored_and_removed_hashes_agree_with_vllm_zmq_events(clean6: Engine) -> None:
    events_tests.test_stored_and_removed_hashes_agree_with_vllm_zmq_events(clean6)


def test_tokens_hits_and_eviction_order_match_stock_vllm(stock6: Engine, hybrid6: Engine) -> None:
    """No hints: the same tokens, prefix hits and vLLM KV events (all six groups', in order) as
    stock vLLM. One session, as on the two-group model: a 780-token prefill takes six copies."""
    identity_tests.test_tokens_hits_and_eviction_order_match_stock_vllm((stock6, hybrid6, ("a",)))


@pytest.mark.timeout(1200)  # the whole suite, engine start included: a hang guard, not a time limit
def test_conformance_suite_passes(hybrid6: Engine) -> None:
    """Every advertised case passes. The two pin-budget cases skip, saying why: exceeding a
    budget of 119 logical blocks takes five 25-block sessions cached at once, 316 device blocks
    over six groups, more than the pool; evict-max-blocks runs with a 3-block session (the
    96-token window's cached tail), so its repeat still hits the prefix it left."""
    text, skipped = conformance_passes(hybrid6)
    budget = {i: r for i, r in skipped.items() if "/clipping/" in i}
    assert set(budget) == {"kvhint.v1/clipping/pin-budget", "kvhint.v1/clipping/pin-budget-freed-by-release"}, text
    assert all("316 device blocks" in r for r in budget.values()), budget
    passed = int(re.search(r"^PASS: (\d+) passed", text, re.M).group(1))  # type: ignore[union-attr]
    assert passed >= 90, text
