"""`bench.scale_ablation` on a small shape: each variant is measured on its own stock/KvHint pair
and the no-op'd piece really is out of the KvHint side's path. Timings are not asserted."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench import scale_ablation
from bench.scale_driver import Pair
from bench.scale_workload import Shape

SMALL = Shape(2048, 50, steps=4, warmup_steps=2, system_tokens=256, first_context_tokens=64, max_tokens=16,
              arrivals_per_step=4, max_model_len=1024, max_num_seqs=64)


def test_every_variant_gives_a_row_and_the_table_lists_them() -> None:
    names = ("full", "hooks only", "A/A, ballast")
    raw = {"command": "python -m bench.scale_ablation", "shape": SMALL.label,
           "rows": [scale_ablation.measure(SMALL, name) for name in names]}
    assert [r["variant"] for r in raw["rows"]] == list(names)
    for row in raw["rows"]:
        assert row["steps"] == SMALL.steps and row["stock_ms_per_step"] > 0 and row["median_ratio"] > 0
    assert raw["rows"][0]["ballast_bytes"] is None and raw["rows"][2]["ballast_bytes"] > 0
    text = scale_ablation.markdown(raw)
    assert "| full |" in text and "| hooks only |" in text and "| A/A, ballast (" in text


def test_reclassed_keeps_kvhint_running_on_the_same_objects() -> None:
    """The variant that measures the re-classing penalty alone: the KvHint side keeps its
    objects, their classes and all of KvHint's work (its steps still publish residency)."""
    pair = Pair(SMALL)
    try:
        pair.fill()
        manager = pair.kv.sched.kv_cache_manager
        pool, core = manager.block_pool, pair.kv.core
        types = (type(pool), type(manager))
        last = core.bus.last_sequence
        scale_ablation.VARIANTS["re-classed"][0](pair)
        pair.steps(3, "steady")
        pair.kv.settle()
        assert pair.kv.sched.kv_cache_manager is manager and manager.block_pool is pool
        assert (type(pool), type(manager)) == types
        assert core.bus.last_sequence > last
        assert pair.units[-1].kv_ns > 0 and pair.kv.running() == pair.stock.running()
    finally:
        pair.close()


def test_hooks_only_leaves_the_index_and_the_event_stream_alone() -> None:
    pair = Pair(SMALL)
    try:
        pair.fill()
        core = pair.kv.core
        nodes, last = len(core.index.nodes), core.bus.last_sequence
        assert nodes > 0
        scale_ablation.VARIANTS["hooks only"][0](pair)
        pair.steps(3, "steady")
        assert core.bus.last_sequence == last  # nothing was stored or removed through the callbacks
        assert pair.counter.take() == (0, 0)
    finally:
        pair.close()


def test_repeated_pairs_are_summarised_per_variant_and_listed_per_pair() -> None:
    def row(variant: str, round_: int, median: float, totals: float, extra: float) -> dict[str, object]:
        return {"variant": variant, "round": round_, "ballast_bytes": None, "steps": 4, "median_ratio": median,
                "ratio_of_totals": totals, "stock_ms_per_step": 5.0, "extra_us_per_step": extra}

    rows = [row("full", 0, 1.07, 1.15, 350), row("A/A", 0, 0.99, 1.0, -50),
            row("full", 1, 1.04, 1.05, 200), row("A/A", 1, 1.02, 1.01, 100),
            row("full", 2, 1.05, 1.08, 250), row("A/A", 2, 0.96, 0.97, -200)]
    raw = {"command": "python -m bench.scale_ablation --repeat 3", "shape": SMALL.label, "bookkeeping": "deferred",
           "repeat": 3, "rows": rows}
    text = scale_ablation.markdown(raw)
    assert "| full | 3 | 1.050x (1.040x - 1.070x) | 1.080x (1.050x - 1.150x) |" in text
    assert "| A/A | 3 | 0.990x (0.960x - 1.020x) | 1.000x (0.970x - 1.010x) |" in text
    # Each pair's row, compared with the full variant of its own round.
    assert "| A/A, pair 2 | 1.020x | 1.010x | 5.000 | 100 | -100 |" in text


def test_repeat_below_one_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as exc:
        scale_ablation.main(["--repeat", "0"])
    assert exc.value.code == 2


def test_a_named_shape_brings_its_fields_and_wins_over_bookkeeping() -> None:
    hybrid = scale_ablation.build_shape(2048, 50, 4, "inline", "hybrid")
    assert hybrid.hybrid and hybrid.async_scheduling and hybrid.bookkeeping == "inline"
    deferred = scale_ablation.build_shape(2048, 50, 4, "inline", "deferred")
    assert deferred.bookkeeping == "deferred" and not deferred.hybrid
    assert not scale_ablation.build_shape(2048, 50, 4, "auto").hybrid
    with pytest.raises(SystemExit):
        scale_ablation.main(["--shape", "aa"])  # the stock-vs-stock null is a variant here, not a shape


# ---------------------------------------------------------------- where the settler's work lands

SETTLER = Shape(2048, 50, steps=4, warmup_steps=2, system_tokens=256, first_context_tokens=64, max_tokens=16,
                arrivals_per_step=4, max_model_len=1024, max_num_seqs=64, async_scheduling=True,
                settler_thread=True, gpu_wait_s=0.02)


def _pending_at_update(pair: Pair) -> list[int]:
    """The journal's pending entries each time the KvHint side's update_from_output() starts."""
    seen: list[int] = []
    sched, journal = pair.kv.sched, pair.kv.core.journal
    update = sched.update_from_output

    def watched(*a: object, **k: object) -> object:
        seen.append(journal.pending())
        return update(*a, **k)

    sched.update_from_output = watched
    return seen


@pytest.fixture
def settler_pair() -> Iterator[Pair]:
    """A filled pair of the settler shape (its settler thread running), closed afterwards."""
    pair = Pair(SETTLER)
    try:
        pair.fill_and_freeze()
        yield pair
    finally:
        pair.close()


def test_settled_after_the_unit_leaves_the_device_wait_to_the_engine(settler_pair: Pair) -> None:
    """As shipped, the settler books what schedule() journaled during the device wait (woken
    where schedule() ends); with the variant, nothing wakes it there, so those entries are still
    pending when update_from_output() starts, and are booked after the unit all the same."""
    pair = settler_pair
    scale_ablation.VARIANTS["settled after the unit"][0](pair)
    seen = _pending_at_update(pair)
    last = pair.kv.core.bus.last_sequence
    pair.steps(6, "steady")
    assert pair.kv.core.journal.pending() == 0 and pair.kv.core.bus.last_sequence > last
    assert any(seen), seen


def test_settled_inline_stops_the_settler_and_the_driver_settles(settler_pair: Pair) -> None:
    pair = settler_pair
    journal = pair.kv.core.journal
    scale_ablation.VARIANTS["settled inline after the unit"][0](pair)
    last = pair.kv.core.bus.last_sequence
    pair.steps(3, "steady")
    assert journal._thread is None and journal.deferring  # deferred, no thread
    assert journal.pending() == 0 and pair.kv.core.bus.last_sequence > last
    assert sum(u.kv_settle_ns for u in pair.units[-3:]) > 0  # the driver's own settle, timed apart


@pytest.mark.parametrize("variant", ["settler settles nothing", "settler settles nothing, collects after the unit"])
def test_a_settler_that_settles_nothing_leaves_the_index_alone(settler_pair: Pair, variant: str) -> None:
    pair = settler_pair
    core = pair.kv.core
    scale_ablation.VARIANTS[variant][0](pair)
    last = core.bus.last_sequence
    pair.steps(3, "steady")
    assert core.journal.pending() == 0 and core.bus.last_sequence == last  # dropped, not booked
    assert core.journal._thread is not None  # the settler still runs
    if variant.endswith("after the unit"):
        assert core.journal.collect_young() is False  # the settler's own collection is off


def test_the_settler_variants_need_the_settler_shape(capsys: pytest.CaptureFixture[str]) -> None:
    assert all(v not in scale_ablation.default_variants("async") for v in scale_ablation.SETTLER_VARIANTS)
    assert all(v in scale_ablation.default_variants("settler") for v in scale_ablation.SETTLER_VARIANTS)
    with pytest.raises(SystemExit):
        scale_ablation.main(["--shape", "async", "--variants", "settler settles nothing"])
    assert "it needs --shape settler" in capsys.readouterr().err
    pair = Pair(SMALL)
    try:
        with pytest.raises(ValueError, match="needs --shape settler"):
            scale_ablation.VARIANTS["settled after the unit"][0](pair)
    finally:
        pair.close()


def test_stock_methods_runs_vllms_own_methods_and_puts_kvhints_back() -> None:
    """"stock methods": during the run the KvHint side's pool, manager and scheduler run vLLM's
    own methods (no KvHint override is found on their classes); after it every override is back."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from engine_integration.hooks import KvHintBlockPool, KvHintKVCacheManager
    from engine_integration.scheduler import KvHintScheduler

    before = {(cls, name): vars(cls)[name] for cls, name in scale_ablation._stock_overrides()}
    assert {name for cls, name in before if cls is KvHintBlockPool} >= {"get_new_blocks", "cache_full_blocks"}
    assert (KvHintScheduler, "schedule") in before
    pair = Pair(SMALL)
    try:
        pair.fill()
        pool = pair.kv.sched.kv_cache_manager.block_pool
        undo = scale_ablation.VARIANTS["stock methods"][0](pair)
        try:
            assert type(pool).get_new_blocks is BlockPool.get_new_blocks
            assert type(pool).cache_full_blocks is BlockPool.cache_full_blocks
            assert KvHintKVCacheManager.free is KVCacheManager.free
            assert not any(name in vars(cls) for cls, name in before)
            from vllm.v1.core.sched.scheduler import Scheduler

            # The timed entry points are vLLM's, timed once: each step's KvHint-side time is
            # about the stock side's (twice it, were the Side's timers timed again).
            pair.units.clear()
            pair.steps(6, "steady")
            assert type(pair.kv.sched).schedule is Scheduler.schedule
            kv, stock = sum(u.kv_ns for u in pair.units), sum(u.stock_ns for u in pair.units)
            assert 0.5 < kv / stock < 1.6 and pair.kv.running() == pair.stock.running()
        finally:
            undo()
        assert {(cls, name): vars(cls)[name] for cls, name in before} == before
    finally:
        pair.close()
