"""bench.step_overhead tables are derived from committed raw per-step timings (no engine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import step_overhead as so

REPO = Path(__file__).resolve().parents[2]
TABLES = sorted(p.relative_to(REPO) for p in (REPO / "bench/results").glob("step_overhead*.md"))


@pytest.mark.parametrize("table", TABLES, ids=str)
def test_committed_table_regenerates_from_its_raw_timings(table: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    csv_path, meta_path = so.raw_paths(table)
    assert csv_path.is_file() and meta_path.is_file(), f"{table} has no raw timings ({csv_path}, {meta_path})"
    so.report(table, dest=tmp_path / "t.md")
    assert (tmp_path / "t.md").read_text() == table.read_text(), f"{table} differs from what its raw timings give"


class _Timer:
    def __init__(self, sched: list[float], step: list[float]) -> None:
        self.sched_s, self.step_s = sched, step


def test_raw_round_trip_and_paired_ratios(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(so, "RAW_DIR", tmp_path / "raw")
    stock = _Timer([1e-4, 2e-4, 4e-4], [1e-3, 2e-3, 3e-3])
    other = _Timer([2e-4, 2e-4, 2e-4], [1e-3, 2e-3])  # took one step fewer
    meta = {"argv": ["--rounds", "1"], "preset": "tiny", "num_blocks": 80, "rounds": 1, "requests": 3, "max_tokens": 4, "aa": False}
    out = tmp_path / "x.md"
    so.write_raw(out, meta, stock, other)  # type: ignore[arg-type]
    got_meta, cols = so.read_raw(out)
    assert got_meta == meta
    assert cols["stock_sched_us"] == pytest.approx(stock.sched_s) and cols["other_step_us"] == pytest.approx(other.step_s)
    text = so.report(out)
    # scheduler: per-step ratios 2, 1, 0.5 -> median 1; totals 6/7; medians 2/2
    assert "| scheduler (schedule + update_from_output) | 3 | 0.200 | 0.200 | 1.000x | 0.857x | 1.000x |" in text
    # engine step: paired over the 2 common steps
    assert "| engine step | 2 | 2.000 | 1.500 | 1.000x | 1.000x | 1.000x |" in text
    assert "--report-only --out " + str(out) in text
