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
    text = scale_profile.markdown(result, "python -m bench.scale_profile", top=5)
    assert text.count("\n| `") == 5
