"""`bench.scale_gc_probe` on a small shape: both passes run through the pair's real steps and
settle, and the table lists what they measured. Timings and counts are not asserted."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

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


def test_an_aa_pair_measures_the_process_without_kvhint() -> None:
    pair = Pair(SMALL, aa=True)
    try:
        pair.fill()
        assert pair.kv.core is None  # the second side is stock too
        collections = scale_gc_probe.collections_pass(pair, 4)
        young = scale_gc_probe.young_pass(pair, 4)
    finally:
        pair.close()
    assert set(young) == {"stock", "stock-b", "settle"}
    assert young["settle"]["max"] == 0  # nothing to settle without KvHint
    raw = {"command": "python -m bench.scale_gc_probe --aa", "commit": "abc", "shape": SMALL.label, "steps": 4, "aa": True,
           "collections": collections, "young": young}
    assert "stock-b / stock scheduler CPU" in scale_gc_probe.markdown(raw)


@pytest.mark.parametrize("before", [False, True])
def test_freeze_before_fill_freezes_the_heap_before_the_history_is_built(
    before: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    order: list[str] = []
    freeze, fill = gc.freeze, Pair.fill

    def freeze_and_note() -> None:
        order.append("freeze")
        freeze()

    def fill_and_note(self: Pair) -> dict[str, int]:
        order.append("fill")
        return fill(self)

    monkeypatch.setattr(gc, "freeze", freeze_and_note)
    monkeypatch.setattr(Pair, "fill", fill_and_note)
    monkeypatch.setattr(scale_gc_probe, "Shape", lambda *a, **k: SMALL)
    out = tmp_path / "probe.md"
    argv = ["--steps", "2", "--out", str(out)] + (["--freeze-before-fill"] if before else [])
    assert scale_gc_probe.main(argv) == 0
    assert order == (["freeze", "fill"] if before else ["fill", "freeze"])
    assert ("--freeze-before-fill" in out.read_text()) is before


def test_no_settler_gc_is_refused_for_an_aa_pair() -> None:
    with pytest.raises(SystemExit):
        scale_gc_probe.main(["--aa", "--no-settler-gc"])


def test_the_census_lists_what_each_settle_leaves_alive_and_restores_the_settle() -> None:
    pair = Pair(SMALL)
    try:
        pair.fill()
        settle, collect = pair.kv.settle, pair.kv.core.journal.collect_young
        census = scale_gc_probe.census_pass(pair, 4)
        assert (pair.kv.settle, pair.kv.core.journal.collect_young) == (settle, collect)
    finally:
        pair.close()
    # Each step stores blocks of sessions: the settle books index nodes and their events.
    assert census["kvhint_server.index.Node"] > 0
    assert census["kvhint_server.events.Event"] > 0
    raw = {"command": "python -m bench.scale_gc_probe", "commit": "abc", "shape": SMALL.label, "steps": 4, "aa": False,
           "collections": {"steps": 4, "median_ratio": 1.0, "totals_ratio": 1.0, "kv_minus_stock_us_per_step": 0,
                           "collections": []},
           "young": {}, "census_steps": 4, "census": census}
    assert "| `kvhint_server.index.Node` |" in scale_gc_probe.markdown(raw)


def test_an_aa_pair_has_no_census() -> None:
    pair = Pair(SMALL, aa=True)
    try:
        pair.fill()
        assert scale_gc_probe.census_pass(pair, 2) == {}
    finally:
        pair.close()
