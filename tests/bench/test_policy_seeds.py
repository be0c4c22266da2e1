"""bench/results/policy/seeds.md is generated from seeds.json by `python -m bench.policy_seeds`."""

from __future__ import annotations

import json
from pathlib import Path

from bench.generate import PRESETS, oracle_pause_state
from bench.policy_seeds import ORACLE_VARIANTS, OUT, PRESET_NAMES, VARIANTS, markdown
from kvhint_client.policy import PauseModel


def test_committed_seeds_table_comes_from_its_raw_results() -> None:
    raw = json.loads(Path(OUT + ".json").read_text())
    assert markdown(raw) == Path(OUT + ".md").read_text()
    # Every variant ran on every preset and seed, cold and warm.
    assert set(raw["variants"]) == set(VARIANTS)
    keys = {(r["variant"], r["preset"], r["seed"]) for r in raw["rows"]}
    assert len(keys) == len(raw["rows"]) == (len(VARIANTS) + len(ORACLE_VARIANTS)) * len(PRESET_NAMES) * raw["seeds"]


def test_the_oracle_state_is_the_generators_own_mixture() -> None:
    """The ceiling's pause state loads into the policy's model, and each declared class holds the
    generator's mixture: mostly its own range, plus the mispredicted calls of the other class."""
    params = PRESETS["default"]
    state = oracle_pause_state(params, samples=256)
    PauseModel().load(state)  # a valid export
    by_key = {tuple(k["key"]): k["samples"] for k in state["keys"]}
    assert set(by_key) == {("declared", "short"), ("declared", "long")}
    for cls, (lo, hi), other in (("short", params.short_pause_s, params.long_pause_s),
                                 ("long", params.long_pause_s, params.short_pause_s)):
        xs = by_key[("declared", cls)]
        assert len(xs) == 256
        own = sum(lo <= x <= hi for x in xs)
        flipped = sum(other[0] <= x <= other[1] for x in xs)
        assert own + flipped == 256 and own > 128 and flipped > 0, (cls, own, flipped)


def test_the_never_worse_than_lru_line_names_a_trace_that_is() -> None:
    rows = [{"variant": "quantile 0.7 (default)", "preset": p, "seed": s, "lru": 100, "belady": 50, "cold": 80, "warm": 90}
            for p in PRESET_NAMES for s in (0, 1)]
    rows[3]["warm"] = 104  # one trace where the warm policy recomputes more than LRU
    raw = {"command": "x", "seeds": 2, "variants": {"quantile 0.7 (default)": {}}, "oracle_variants": {}, "rows": rows}
    text = markdown(raw)
    n = len(rows)
    assert f"* cold: recomputed tokens at most 0.800x LRU's (default seed 0), more than LRU on 0 of {n} traces: met." in text
    assert f"* warm: recomputed tokens at most 1.040x LRU's ({rows[3]['preset']} seed {rows[3]['seed']}), more than LRU on 1 of {n} traces: missed." in text
