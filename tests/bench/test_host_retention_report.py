"""bench.host_retention_report: the table of host retention against the LRU host is computed
from the result directories it is given (medians over every repeat of each group), and
directories that replayed different traces are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.host_retention_report import main


def _results(root: Path, name: str, offload: list[int], policy: list[int], infinite: int = 1000) -> str:
    d = root / name
    d.mkdir()
    runs = {"offload": [{"recomputed_tokens": v} for v in offload], "policy+tiers": [{"recomputed_tokens": v} for v in policy]}
    data = {"runs_each_repeat": runs, "offline": {"results": {"infinite": {"recomputed_tokens": infinite}}},
            "code_version": {"commit": "abcdef0123"}}
    (d / "results.json").write_text(json.dumps(data))
    return str(d)


def test_medians_and_ratios_come_from_every_repeat(tmp_path: Path) -> None:
    kv = [_results(tmp_path, "kv1", [100, 102], [70, 74]), _results(tmp_path, "kv2", [98, 100], [72, 90])]
    lru = [_results(tmp_path, "lru1", [100, 100], [80, 80])]
    before = [_results(tmp_path, "old", [100, 100], [84, 84])]
    out = tmp_path / "report.md"
    main(["--retention", *kv, "--lru", *lru, "--before", *before, "--out", str(out)])
    text = out.read_text()
    assert "| host-eviction=kvhint | 100 | 73 | 0.73x | 0.07x |" in text  # medians of 4 repeats each
    assert "| LRU (vLLM's) | 100 | 80 | 0.80x | 0.08x |" in text
    assert "(g2) with host retention / (g2) with the LRU host: 0.91x" in text
    assert "(g2) 1.05x the LRU host's; with grants that outlive the device copy: 0.87x the code before" in text
    assert "| host-eviction=kvhint | `" + kv[1] + "` | abcdef0 | 98, 100 | 72, 90 |" in text


def test_directories_of_different_traces_are_refused(tmp_path: Path) -> None:
    kv = _results(tmp_path, "kv", [100], [70], infinite=1000)
    lru = _results(tmp_path, "lru", [100], [80], infinite=999)
    with pytest.raises(SystemExit, match="different traces"):
        main(["--retention", kv, "--lru", lru, "--out", str(tmp_path / "r.md")])


def test_a_directory_without_results_is_a_clear_error(tmp_path: Path) -> None:
    lru = _results(tmp_path, "lru", [100], [80])
    with pytest.raises(SystemExit, match="cannot read"):
        main(["--retention", str(tmp_path / "missing"), "--lru", lru, "--out", str(tmp_path / "r.md")])
