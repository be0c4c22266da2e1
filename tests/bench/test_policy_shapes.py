"""bench/results/policy/shapes.md is generated from shapes.json by `python -m bench.policy_shapes`,
and the shapes it draws are what its rows say."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from bench import policy_shapes
from bench.generate import PRESETS
from bench.policy_shapes import DRAWN, OUT, VARIANTS, draw_shape, markdown, measure


def test_committed_shapes_table_comes_from_its_raw_results() -> None:
    raw = json.loads(Path(OUT + ".json").read_text())
    assert markdown(raw) == Path(OUT + ".md").read_text()
    assert raw["variants"] == list(VARIANTS)
    assert [r["shape"] for r in raw["rows"]] == list(range(len(raw["rows"])))
    for row in raw["rows"]:
        assert set(row["variants"]) == set(VARIANTS)
        assert row["belady"] <= row["lru"]  # the clairvoyant reference never does worse than LRU
        # Where a variant recomputed more than LRU, its per-resume breakdown adds up to the difference.
        worse = {label for label, v in row["variants"].items() if v > row["lru"]}
        breakdown = row.get("cached_vs_lru_by_resume", {})
        assert set(breakdown) == worse
        for label in worse:
            assert sum(breakdown[label].values()) == row["lru"] - row["variants"][label] < 0


def test_the_committed_draws_are_the_seeds_draws() -> None:
    """Rows record what `draw_shape` gives for the seed, so a row can be generated again."""
    raw = json.loads(Path(OUT + ".json").read_text())
    rng = random.Random(raw["seed"])
    for row in raw["rows"][:5]:
        base, params = draw_shape(rng)
        assert rng.randrange(10**6) == row["trace_seed"] and base == row["base"]
        drawn = {k: getattr(params, k) for k in DRAWN}
        assert json.loads(json.dumps(drawn)) == row["params"]


def test_a_shape_changes_only_the_drawn_fields_of_its_preset() -> None:
    base, params = draw_shape(random.Random(7))
    preset = PRESETS[base]
    changed = {k for k in vars(preset) if getattr(preset, k) != getattr(params, k)}
    assert changed and changed <= set(DRAWN)


def test_measure_then_report(tmp_path: Path) -> None:
    rows = measure(2, seed=3, variants={"quantile 0.7 (default)": {}})
    assert len(rows) == 2 and all(r["belady"] <= r["lru"] for r in rows)
    over = dict(rows[0])
    over["variants"] = {"quantile 0.7 (default)": over["lru"] + 1}  # recomputes more than LRU
    text = markdown({"command": "x", "seed": 3, "variants": ["quantile 0.7 (default)"], "rows": [over, rows[1]]})
    assert "| quantile 0.7 (default) |" in text and "| 1 of 2 |" in text
    assert f"* shape {over['shape']} (base {over['base']}, trace seed {over['trace_seed']})" in text


def test_zero_shapes_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as err:
        policy_shapes.main(["--shapes", "0", "--out", "/nonexistent/x"])
    assert err.value.code == 2
