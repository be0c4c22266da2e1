"""`bench.scale_ab`: a run of one shape in a child process on a given tree, and the table's
per-round differences. Timings are not asserted."""

from __future__ import annotations

from pathlib import Path

from bench import scale_ab

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(warmup_steps=2, system_tokens=256, first_context_tokens=64, max_tokens=16, arrivals_per_step=4,
             max_model_len=1024, max_num_seqs=64)


def test_a_child_run_measures_the_shape_on_the_given_tree() -> None:
    row = scale_ab.run_one(ROOT, "grants", steps=3, pool=2048, sessions=50, extra=SMALL)
    assert row["steps"] == 3 and row["median"] > 0 and row["totals"] > 0 and row["stock_ms"] > 0


def test_the_table_pairs_each_rounds_versions() -> None:
    rows = []
    for rnd, (base, head) in enumerate([(1.05, 1.03), (1.07, 1.04)]):
        for version, median in (("base", base), ("head", head)):
            rows.append({"round": rnd, "shape": "grants", "version": version, "median": median, "totals": median,
                         "stock_ms": 5.0, "extra_us": 100.0})
    raw = {"command": "python -m bench.scale_ab --base X", "base": "X", "base_commit": "a" * 40,
           "head_commit": "b" * 40, "head_dirty": False, "steps": 3, "shapes": ["grants"], "rows": rows}
    text = scale_ab.markdown(raw)
    line = next(x for x in text.splitlines() if x.startswith("| grants |"))
    assert "1.060x (1.050x - 1.070x)" in line and "1.035x (1.030x - 1.040x)" in line
    assert line.endswith("| -2.0, -3.0 points |")


def test_the_profile_counts_kvhint_frames_on_the_kvhint_side_only() -> None:
    from bench import scale_profile

    result = scale_profile.profile("deferred", steps=3, pool=2048, sessions=50, extra=SMALL)
    rows = {r["function"]: r for r in result["rows"]}
    record = next(r for name, r in rows.items() if name.startswith("journal.py:") and name.endswith("(record)"))
    assert record["stock_calls"] == 0 and record["kvhint_calls"] > 0  # the deferred hooks journal every change
    assert result["totals"]["stock"] > 0 and result["totals"]["kvhint"] > 0
    text = scale_profile.markdown(result, "python -m bench.scale_profile", top=6)
    grew, shrank = text.split("shrank most")
    assert grew.count("\n| `") == 6
    assert 1 <= shrank.count("\n| `") <= 2  # top // 3 rows, when any function shrank
    assert all(float(line.rsplit("|", 2)[1]) < 0 for line in shrank.splitlines() if line.startswith("| `"))


def test_the_entry_timers_time_the_same_vllm_calls_on_both_sides() -> None:
    from bench import scale_profile

    result = scale_profile.entry_timers("deferred", steps=3, pool=2048, sessions=50, extra=SMALL)
    rows = {r["method"]: r for r in result["rows"]}
    assert list(rows) == [name for _, name in scale_profile.ENTRY_POINTS]
    # Without grants KvHint evicts as stock vLLM does, so the same workload reaches vLLM's entry
    # points as often on both sides: the timers wrap vLLM's calls into the pool and the manager,
    # not KvHint's own calls to the stock methods.
    # (But get_num_free_blocks: vLLM's get_new_blocks calls it once per allocation, KvHint's reads
    # the queue's count itself.)
    same = {name: r for name, r in rows.items() if name != "get_num_free_blocks"}
    assert all(r["kvhint_calls"] == r["stock_calls"] for r in same.values()), same
    assert rows["get_num_free_blocks"]["stock_calls"] - rows["get_num_free_blocks"]["kvhint_calls"] == rows["get_new_blocks"]["stock_calls"]
    for name in ("allocate_slots", "cache_full_blocks", "get_new_blocks", "get_computed_blocks"):
        assert rows[name]["stock_calls"] > 0 and rows[name]["kvhint_ns"] > 0 and rows[name]["stock_ns"] > 0, name
    text = scale_profile.entry_markdown(result, "python -m bench.scale_profile --method entry-timers")
    assert text.count("\n| `") == len(scale_profile.ENTRY_POINTS)
    assert "| `BlockPool.cache_full_blocks` |" in text and "| `KVCacheManager.allocate_slots` |" in text


def test_the_hybrid_shape_runs_both_sides_on_two_kv_cache_groups_and_reports_logical_blocks() -> None:
    from bench.scale_driver import Pair
    from bench.scale_workload import Shape
    from engine_integration import vllm_private

    shape = Shape(1024, 50, steps=3, **{**scale_ab.SHAPES["hybrid"], **SMALL, "system_tokens": 512})
    assert "hybrid layout" in shape.label
    pair = Pair(shape, collect=False)
    try:
        pair.fill_and_freeze()
        pair.steps(12, "steady")
        assert sum(u.evicted for u in pair.units) > 0  # the pool is under pressure
        for side in (pair.stock, pair.kv):
            specs = [type(g.kv_cache_spec).__name__ for g in side.sched.kv_cache_config.kv_cache_groups]
            assert specs == ["FullAttentionSpec", "SlidingWindowSpec"], side.name
        pair.kv.settle()
        adapter = pair.kv.sched.kvhint_adapter
        keys = vllm_private.cached_block_map(adapter.pool).keys()
        full = {key[:-4] for key in keys if key[-4:] == (0).to_bytes(4, "big")}
        window = {key[:-4] for key in keys if key[-4:] == (1).to_bytes(4, "big")}
        # Residency is logical and follows the full-attention group: every block it holds and
        # no other; the window group keeps only each prompt's tail.
        assert {adapter.external(d) for d in full} == {b.block_hash for b in adapter.device_blocks()}
        assert window and len(window) < len(full)
    finally:
        pair.close()
