"""bench.scan_cost: the scan variants it compares find the same blocks, and its report."""

from __future__ import annotations

import random

import pytest

from bench import scan_cost


def test_the_shipped_refile_scan_finds_exactly_the_free_granted_blocks():
    blocks, grants = scan_cost.make_blocks(400, 0.3, 0.5, random.Random(1))
    want = sum(1 for b in blocks if b.ref_cnt == 0 and b._block_hash[scan_cost.CUT] in grants)
    assert want > 0
    case = scan_cost.freed(blocks, grants)
    for scan in (scan_cost.refile_shipped, scan_cost.refile_comprehension, scan_cost.refile_map, scan_cost.refile_compress):
        assert scan(case) == want, scan.__name__


def test_the_touch_scans_find_filed_free_blocks_and_only_those():
    blocks, _ = scan_cost.make_blocks(200, 0.5, 0.0, random.Random(2))
    free = [b for b in blocks if b.ref_cnt == 0]
    busy = [b for b in blocks if b.ref_cnt != 0]
    filed = {free[0].block_id: None, busy[0].block_id: None}
    # The free filed block counts; the filed block in use does not (it is not in the free queue).
    assert scan_cost.touch_shipped(blocks, filed) == 1
    assert scan_cost.touch_isdisjoint(blocks, filed) == 1


def test_measure_refuses_variants_that_disagree(monkeypatch):
    monkeypatch.setitem(scan_cost.SCANS, "refile, map", ("refile", lambda case: -1))
    with pytest.raises(AssertionError, match="disagree"):
        scan_cost.measure({"refile": 20, "touch": 20}, [0.5], rounds=1, number=1)


def test_quick_run_reports_every_scan_against_the_shipped_one(capsys):
    assert scan_cost.main(["--quick"]) == 0
    out = capsys.readouterr().out
    for name in scan_cost.SCANS:
        assert f"| {name} | 50 | 0.17 |" in out
    assert "| refile, shipped | 50 | 0.17 |" in out and "| 1.00x |" in out
