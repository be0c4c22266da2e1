"""`bench.scale_gc_probe` on a small shape: both passes run through the pair's real steps and
settle, and the table lists what they measured. Timings and counts are not asserted."""

from __future__ import annotations

from bench import scale_gc_probe
from bench.scale_driver import Pair
from bench.scale_workload import Shape

SMALL = Shape(2048, 50, steps=4, warmup_steps=2, system_tokens=256, first_context_tokens=64, max_tokens=16,
              arrivals_per_step=4, max_model_len=1024, max_num_seqs=64, bookkeeping="deferred")


def test_both_passes_measure_every_region_and_restore_the_pair() -> None:
    pair = Pair(SMALL)
    try:
        pair.fill()
        steps = (pair.stock.step, pair.kv.step, pair.kv.settle)
        collections = scale_gc_probe.collections_pass(pair, 4)
        young = scale_gc_probe.young_pass(pair, 4)
        assert (pair.stock.step, pair.kv.step, pair.kv.settle) == steps  # the wrappers are undone
    finally:
        pair.close()
    assert collections["steps"] == 4 and collections["median_ratio"] > 0
    assert set(young) == {"kvhint", "stock", "settle"}
    raw = {"command": "python -m bench.scale_gc_probe", "commit": "abc", "shape": SMALL.label, "steps": 4,
           "collections": collections, "young": young}
    text = scale_gc_probe.markdown(raw)
    assert "| settle |" in text and "| kvhint |" in text and "| stock |" in text
