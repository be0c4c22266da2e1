"""`bench.scale_target`: the verdict over repeated runs (the child run it uses is
tests/bench/test_scale_ab.py's). Timings are not asserted."""

from __future__ import annotations

from bench import scale_target


def _rows(medians: dict[str, list[float]]) -> list[dict[str, float | int | str]]:
    return [{"round": i, "shape": shape, "median": m, "totals": m, "stock_ms": 5.0, "extra_us": 100.0}
            for shape, ms in medians.items() for i, m in enumerate(ms)]


def test_the_verdict_takes_each_no_hint_shapes_median_of_runs_and_leaves_grants_out() -> None:
    rows = _rows({"aa": [0.99, 1.01, 1.00], "deferred": [1.02, 1.05, 1.03], "async": [1.01, 1.02, 1.04],
                  "settler": [1.06, 1.02, 1.03], "grants": [1.07, 1.08, 1.09]})
    v = scale_target.verdict(rows)
    assert v["met"]  # medians 1.03, 1.02, 1.03: each at the target; grants at 1.08 is not judged
    assert v["shapes"]["settler"]["at_or_under_target"] == 2 and v["shapes"]["deferred"]["max"] == 1.05
    raw = {"command": "python -m bench.scale_target", "machine": "m", "vllm": "0.32.0", "commit": "c" * 40,
           "dirty": False, "rounds": 3, "steps": 3, "wall_s": 60.0, "rows": rows, "verdict": v}
    text = scale_target.markdown(raw)
    assert "met.**" in text and "1.080x" in text

    rows = _rows({"deferred": [1.02, 1.02, 1.02], "async": [1.01, 1.02, 1.01], "settler": [1.031, 1.04, 1.02]})
    v = scale_target.verdict(rows)
    assert not v["met"]  # settler's median of runs, 1.031x, is over
    assert "missed.** Highest no-hint shape: settler, 1.031x." in scale_target.markdown({**raw, "rows": rows, "verdict": v})


def test_no_judged_shape_is_no_verdict_of_met() -> None:
    assert not scale_target.verdict(_rows({"aa": [1.0], "grants": [1.0]}))["met"]


def test_the_step_order_is_balanced_out_of_a_runs_ratio() -> None:
    """A step's ratio depends on which side ran first; a run whose steps split 83 / 67 between the
    orders gets the geometric mean of the two orders' medians, not a median leaning to one."""
    from bench.scale_driver import Unit, balanced_ratio

    def unit(ratio: float, kv_first: int) -> Unit:
        return Unit("steady", 1000, int(1000 * ratio), 0, 0, 0, 0, kv_first=kv_first)

    units = [unit(1.05, 0)] * 83 + [unit(0.99, 1)] * 67
    assert abs(balanced_ratio(units) - (1.05 * 0.99) ** 0.5) < 1e-3
    assert balanced_ratio([unit(1.05, 0)] * 5) == 1.05  # one order only: the plain median


def test_rounds_alternate_which_side_is_built_first(monkeypatch) -> None:
    seen: list[tuple[int, bool]] = []

    def run_one(tree, shape, steps, extra=None):
        seen.append((len(seen), extra["kv_first"]))
        return {"median": 1.0, "totals": 1.0, "stock_ms": 1.0, "extra_us": 0.0, "kv_first": extra["kv_first"]}

    monkeypatch.setattr(scale_target, "run_one", run_one)
    monkeypatch.setattr(scale_target, "write_results", lambda out, raw, text: None)
    assert scale_target.main(["--rounds", "4", "--shapes", "aa", "--steps", "1"]) == 0
    assert [kv for _, kv in seen] == [False, True, False, True]
