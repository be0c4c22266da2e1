"""bench.reclass_probe runs end to end on small numbers and writes its table (timings are not
asserted); bad arguments are usage errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import reclass_probe


def test_the_probe_writes_one_row_per_method(tmp_path: Path) -> None:
    out = tmp_path / "probe.md"
    assert reclass_probe.main(["--calls", "50", "--rounds", "2", "--out", str(out)]) == 0
    text = out.read_text()
    assert "`BlockPool.get_num_free_blocks`" in text and "`KVCacheManager.usage`" in text
    assert "--calls 50 --rounds 2 --out" in text


@pytest.mark.parametrize("args", [["--calls", "0"], ["--rounds", "0"]])
def test_counts_below_one_are_usage_errors(args: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        reclass_probe.main(args)
    assert exc.value.code == 2
