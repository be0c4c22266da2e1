"""bench/results/policy/seeds.md is generated from seeds.json by `python -m bench.policy_seeds`."""

from __future__ import annotations

import json
from pathlib import Path

from bench.policy_seeds import OUT, PRESET_NAMES, VARIANTS, markdown


def test_committed_seeds_table_comes_from_its_raw_results() -> None:
    raw = json.loads(Path(OUT + ".json").read_text())
    assert markdown(raw) == Path(OUT + ".md").read_text()
    # Every variant ran on every preset and seed, cold and warm.
    assert set(raw["variants"]) == set(VARIANTS)
    keys = {(r["variant"], r["preset"], r["seed"]) for r in raw["rows"]}
    assert len(keys) == len(raw["rows"]) == len(VARIANTS) * len(PRESET_NAMES) * raw["seeds"]
