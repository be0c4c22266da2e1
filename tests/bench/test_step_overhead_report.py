"""bench.step_overhead tables are derived from committed raw per-step timings (no engine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import step_overhead as so

REPO = Path(__file__).resolve().parents[2]
TABLES = sorted(p.relative_to(REPO) for p in (REPO / "bench/results").glob("step_overhead*.md"))


@pytest.mark.parametrize("table", TABLES, ids=str)
def test_committed_table_regenerates_from_its_raw_timings(table: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    csv_path, meta_path = so.raw_paths(table)
    assert csv_path.is_file() and meta_path.is_file(), f"{table} has no raw timings ({csv_path}, {meta_path})"
    so.report(table, dest=tmp_path / "t.md")
    assert (tmp_path / "t.md").read_text() == table.read_text(), f"{table} differs from what its raw timings give"


class _Timer:
    def __init__(self, sched: list[float], step: list[float]) -> None:
        self.sched_s, self.step_s = sched, step


def test_raw_round_trip_and_paired_ratios(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(so, "RAW_DIR", tmp_path / "raw")
    stock = _Timer([1e-4, 2e-4, 4e-4], [1e-3, 2e-3, 3e-3])
    other = _Timer([2e-4, 2e-4, 2e-4], [1e-3, 2e-3])  # took one step fewer
    meta = {"argv": ["--rounds", "1"], "preset": "tiny", "num_blocks": 80, "rounds": 1, "requests": 3, "max_tokens": 4, "aa": False}
    out = tmp_path / "x.md"
    so.write_raw(out, meta, stock, other)  # type: ignore[arg-type]
    got_meta, cols = so.read_raw(out)
    assert got_meta == meta
    assert cols["stock_sched_us"] == pytest.approx(stock.sched_s) and cols["other_step_us"] == pytest.approx(other.step_s)
    text = so.report(out)
    # scheduler: per-step ratios 2, 1, 0.5 -> median 1; totals 6/7; medians 2/2
    assert "| scheduler (schedule + update_from_output) | 3 | 0.200 | 0.200 | 1.000x | 0.857x | 1.000x |" in text
    # engine step: paired over the 2 common steps
    assert "| engine step | 2 | 2.000 | 1.500 | 1.000x | 1.000x | 1.000x |" in text
    assert "--report-only --out " + str(out) in text


def test_the_settler_threads_cpu_is_reported_and_charged_to_kvhint_in_the_upper_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With deferred bookkeeping (the GPU default) KvHint's settler works outside both engines'
    timed calls, in the same process: the table says how much and what the engine-step ratio
    is with all of it charged to KvHint; a run without the thread (inline) says nothing of it."""
    monkeypatch.setattr(so, "RAW_DIR", tmp_path / "raw")
    stock, other = _Timer([1e-4] * 4, [1e-3] * 4), _Timer([1e-4] * 4, [1e-3] * 4)
    meta = {"argv": [], "preset": "tiny", "num_blocks": 80, "rounds": 1, "requests": 4, "max_tokens": 4, "aa": False,
            "settler_cpu_ms": 0.4}
    so.write_raw(tmp_path / "x.md", meta, stock, other)  # type: ignore[arg-type]
    text = so.report(tmp_path / "x.md")
    assert "settler thread (deferred bookkeeping) used 0.4 ms of CPU over these steps (100.0 us per step)" in text
    assert "the engine step's ratio of totals is 1.100x" in text  # (4 ms + 0.4 ms) / 4 ms
    so.write_raw(tmp_path / "y.md", {**meta, "settler_cpu_ms": None}, stock, other)  # type: ignore[arg-type]
    assert "settler thread" not in so.report(tmp_path / "y.md")


def test_the_settler_thread_is_found_by_name_and_its_cpu_read() -> None:
    import threading

    assert so.settler_cpu_s() is None  # no KvHint engine in this process
    done = threading.Event()
    thread = threading.Thread(target=lambda: (sum(range(200_000)), done.wait(5)), name=so.SETTLER_THREAD)
    thread.start()
    try:
        import time

        time.sleep(0.05)
        used = so.settler_cpu_s()
        assert used is not None and used > 0
    finally:
        done.set()
        thread.join()


class _Sched:
    def schedule(self) -> None:
        pass

    def update_from_output(self) -> None:
        pass


class _Engine:
    """An LLMEngine stand-in whose steps call the scheduler as `plan` says (async scheduling:
    a step may only schedule, schedule and update, only update, or neither)."""

    def __init__(self, plan: list[tuple[bool, bool]]) -> None:
        self.plan = plan
        self.engine_core = type("Client", (), {})()
        self.engine_core.engine_core = type("Core", (), {})()
        self.engine_core.engine_core.scheduler = _Sched()

    def step(self) -> None:
        sched = self.engine_core.engine_core.scheduler
        schedule, update = self.plan.pop(0)
        if schedule:
            sched.schedule()
        if update:
            sched.update_from_output()


def test_step_timer_counts_only_this_steps_scheduler_calls() -> None:
    engine = _Engine([(True, False), (False, True), (False, False)])
    timer = so.StepTimer(type("LLM", (), {"llm_engine": engine})())
    for _ in range(3):
        timer.step()
    assert timer.sched_s[0] > 0 and timer.sched_s[1] > 0
    assert timer.sched_s[2] == 0.0  # neither ran: not the previous step's time again


def test_model_label_names_the_model_actually_run(tmp_path: Path) -> None:
    (tmp_path / "kvhint_model.json").write_text('{"preset": "hybrid", "seed": 0}')
    (tmp_path / "config.json").write_text('{"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"}')
    described = so.describe_model(tmp_path)
    assert described == {"preset": "hybrid", "architecture": "Gemma2ForCausalLM"}
    assert so.model_label(described) == "generated `hybrid` preset (Gemma2ForCausalLM)"
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "llama"}')
    assert so.describe_model(other) == {"preset": None, "architecture": "llama"}
    assert so.model_label({"model": "/m", **so.describe_model(other)}) == "`/m` (llama)"
    # Runs recorded before the architecture was (the committed tables) keep their wording.
    assert so.model_label({"preset": "tiny"}) == "generated tiny Llama"
    assert so.engines_label({"preset": "tiny"}) == []
    assert so.engines_label({"max_num_seqs": 16, "async_scheduling": True, "enforce_eager": False})[0].startswith(
        "Engines: max_num_seqs 16 (both engines), async scheduling, compiled")
