"""bench.scale's target verdicts on synthetic results: the flatness check goes by the lines of
KvHint's code per strictly quiet step (a count) and uses the timed overhead only as a bound for
work hidden in one line, so run-to-run noise is not a trend and growth is; the baselines other
than plain stock do not enter the targets."""

from __future__ import annotations

from typing import Any

from bench.scale_report import verdicts

Quiet = dict[tuple[int, int], tuple[float, list[int] | None]]  # (pool, sessions) -> (overhead us, lines per step)


def _run(name: str, pool: int, sessions: int, hints: int = 0, **shape: Any) -> dict[str, Any]:
    return {"name": name, "label": name, "aa": False,
            "shape": {"pool_blocks": pool, "sessions": sessions, "hints_per_step": hints, "stock_kv_events": False, **shape}}


def _results(quiet: Quiet, ratio: float = 1.3, hinted: Quiet | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    runs, analyses = [], {}
    for hints, table in ((0, quiet), (20, hinted or {})):
        for (pool, sessions), (us, lines) in table.items():
            run = _run(f"p{pool}_s{sessions}" + ("_hints" if hints else ""), pool, sessions, hints)
            if lines is not None:
                run["quiet_lines"] = {"steps": 11, "lines": lines}
            runs.append(run)
            analyses[run["name"]] = {"steady": {"median_ratio": ratio, "total_ratio": ratio}, "quiet_steps": 240,
                                     "quiet_overhead_us": us}
    return {"runs": runs}, analyses


def _row(lines: list[str], start: str) -> str:
    return next(line for line in lines if line.startswith(start))


def _verdict(raw: dict[str, Any], analyses: dict[str, Any], start: str = "| no per-step work") -> str:
    return _row(verdicts(raw, analyses), start).rsplit("|", 2)[1].strip()


def test_noise_in_the_times_with_the_same_work_is_flat() -> None:
    raw, analyses = _results({(16384, 10000): (17.9, [19]), (131072, 10000): (-2.2, [19]),
                              (524288, 10000): (62.6, [19]), (131072, 100): (9.8, [19])})
    assert _verdict(raw, analyses) == "met"


def test_work_that_grows_with_the_pool_or_the_sessions_is_not_flat() -> None:
    grows_with_pool: Quiet = {(16384, 10000): (5.0, [19]), (131072, 10000): (6.0, [31]), (524288, 10000): (7.0, [55])}
    grows_with_sessions: Quiet = {(131072, 100): (1.0, [19]), (131072, 1000): (2.0, [19, 40]), (131072, 10000): (3.0, [19, 240])}
    hidden_in_one_line: Quiet = {(131072, 100): (1.0, [19]), (131072, 10000): (420.0, [19])}  # same lines, a copy of 10^5
    for quiet in (grows_with_pool, grows_with_sessions, hidden_in_one_line):
        raw, analyses = _results(quiet)
        assert _verdict(raw, analyses) == "missed", quiet


def test_untraced_runs_are_not_called_flat() -> None:
    raw, analyses = _results({(16384, 10000): (3.0, [19]), (131072, 10000): (4.0, None)})
    assert _verdict(raw, analyses) == "missed"
    assert "not traced" in _row(verdicts(raw, analyses), "| no per-step work")


def test_sync_and_async_schedulers_are_compared_within_their_class() -> None:
    raw, analyses = _results({(16384, 10000): (3.0, [19]), (131072, 10000): (4.0, [19])})
    run = _run("async", 131072, 10000, async_scheduling=True)
    run["quiet_lines"] = {"steps": 13, "lines": [4, 19]}
    raw["runs"].append(run)
    analyses["async"] = {"steady": {"median_ratio": 1.3, "total_ratio": 1.3}, "quiet_steps": 280, "quiet_overhead_us": 5.0}
    assert _verdict(raw, analyses) == "met"


def test_grants_in_effect_need_the_same_work_at_two_pool_sizes() -> None:
    plain: Quiet = {(16384, 10000): (3.0, [19]), (131072, 10000): (4.0, [19])}
    same = {(16384, 10000): (20.0, [39, 71]), (131072, 10000): (17.0, [39, 71])}
    grows = {(16384, 10000): (20.0, [39, 71]), (131072, 10000): (17.0, [39, 900])}
    one_pool = {(131072, 10000): (17.0, [39, 71])}
    for hinted, verdict in ((same, "met"), (grows, "missed"), (one_pool, "missed")):
        raw, analyses = _results(plain, hinted=hinted)
        assert _verdict(raw, analyses, "| the same with retention grants") == verdict, hinted


def test_only_plain_stock_runs_enter_the_overhead_target() -> None:
    raw, analyses = _results({(131072, 10000): (5.0, [19]), (524288, 10000): (6.0, [19])}, ratio=1.02)
    ev = _run("ev", 131072, 10000, stock_kv_events=True)
    ev["quiet_lines"] = {"steps": 11, "lines": [19, 400]}
    raw["runs"].append(ev)
    analyses["ev"] = {"steady": {"median_ratio": 2.0, "total_ratio": 2.0}, "quiet_steps": 240, "quiet_overhead_us": 500.0}
    lines = verdicts(raw, analyses)
    assert _row(lines, "| <= 1.03x").endswith("| met |")
    assert _row(lines, "| no per-step work").endswith("| met |")
