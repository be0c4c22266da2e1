"""bench.scale's target verdicts on synthetic results: the flatness check tells per-step work
that grows with the pool or the sessions from run-to-run noise, and the baselines other than
plain stock do not enter the targets."""

from __future__ import annotations

from typing import Any

from bench.scale_report import verdicts


def _results(quiet_us: dict[tuple[int, int], float], ratio: float = 1.3) -> tuple[dict[str, Any], dict[str, Any]]:
    runs, analyses = [], {}
    for (pool, sessions), q in quiet_us.items():
        name = f"p{pool}_s{sessions}"
        runs.append({"name": name, "label": name, "aa": False,
                     "shape": {"pool_blocks": pool, "sessions": sessions, "hints_per_step": 0, "stock_kv_events": False}})
        analyses[name] = {"steady": {"median_ratio": ratio, "total_ratio": ratio}, "quiet_steps": 240, "quiet_overhead_us": q}
    return {"runs": runs}, analyses


def _row(lines: list[str], start: str) -> str:
    return next(line for line in lines if line.startswith(start))


def test_noise_around_zero_is_flat() -> None:
    raw, analyses = _results({(16384, 10000): 17.9, (131072, 10000): -2.2, (524288, 10000): 12.6, (131072, 100): 9.8})
    assert _row(verdicts(raw, analyses), "| no per-step work").endswith("| met |")


def test_work_that_grows_with_the_pool_or_the_sessions_is_not_flat() -> None:
    grows_with_pool = {(16384, 10000): 5.0, (131072, 10000): 40.0, (524288, 10000): 160.0, (131072, 100): 5.0}
    grows_with_sessions = {(131072, 100): 1.0, (131072, 1000): 12.0, (131072, 10000): 120.0}
    for quiet in (grows_with_pool, grows_with_sessions):
        raw, analyses = _results(quiet)
        assert _row(verdicts(raw, analyses), "| no per-step work").endswith("| missed |")


def test_only_plain_stock_runs_enter_the_overhead_target() -> None:
    raw, analyses = _results({(131072, 10000): 5.0, (524288, 10000): 6.0}, ratio=1.02)
    raw["runs"].append({"name": "ev", "label": "ev", "aa": False,
                        "shape": {"pool_blocks": 131072, "sessions": 10000, "hints_per_step": 0, "stock_kv_events": True}})
    analyses["ev"] = {"steady": {"median_ratio": 2.0, "total_ratio": 2.0}, "quiet_steps": 240, "quiet_overhead_us": 500.0}
    lines = verdicts(raw, analyses)
    assert _row(lines, "| <= 1.03x").endswith("| met |")
    assert _row(lines, "| no per-step work").endswith("| met |")
