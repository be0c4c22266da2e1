"""A recorded trace on `kvhint bench run`: what the replay checks before it starts vLLM.

A runtime's trace names its model's context (the format's default max_model_len is 4096) and
the pool it ran with. vLLM refuses to start when one max_model_len request would not fit in the
pool ("the estimated maximum model length is 1888"), so the replay lowers max_model_len to what
the pool holds when every request of the trace still fits, and otherwise stops with the pool
size the trace needs, before starting an engine."""

from __future__ import annotations

import pytest

from bench.agentic_engine import fit_max_model_len, main
from bench.trace import Request, Seg, SessionEnded, ToolCallStarted, Trace, TraceHeader


def _trace(num_gpu_blocks: int, prompt: int = 900, max_model_len: int = 4096) -> Trace:
    events = [
        Request(0.0, "r0", "a", None, "r0", 0, (Seg("sys", 64), Seg("u/a", prompt - 64)), 16),
        ToolCallStarted(0.5, "a", None, tool="pytest"),
        SessionEnded(1.0, "a"),
    ]
    return Trace(TraceHeader(block_size=32, num_gpu_blocks=num_gpu_blocks, max_model_len=max_model_len), events)


def test_max_model_len_is_lowered_to_what_the_pool_holds_when_every_request_fits() -> None:
    tr = _trace(60)
    said = fit_max_model_len(tr)
    assert tr.header.max_model_len == 59 * 32
    assert said is not None and "4096 -> 1888" in said and "needs 916" in said
    tr.validate()  # every request still fits the lowered length
    assert fit_max_model_len(tr) is None  # nothing more to change


def test_a_header_that_fits_its_pool_is_left_alone() -> None:
    tr = _trace(200, max_model_len=2048)
    assert fit_max_model_len(tr) is None and tr.header.max_model_len == 2048


def test_a_request_longer_than_the_pool_stops_with_the_pool_it_needs() -> None:
    tr = _trace(20)  # 19 x 32 = 608 tokens < 916
    with pytest.raises(SystemExit, match=r"request r0 needs 916 tokens .* holds 608: pass --num-gpu-blocks 30 or more"):
        fit_max_model_len(tr)


def test_a_broken_trace_file_stops_before_any_engine_with_its_line(tmp_path) -> None:
    path = tmp_path / "mine.jsonl"
    lines = _trace(60).dumps().splitlines()
    path.write_text("\n".join([lines[0], lines[1], '{"kind": "tool_call_started", "t": 1}']) + "\n")
    with pytest.raises(SystemExit, match=rf"error: {path}: line 3: event has no 'session_id' field"):
        main(["--mode", "fast", "--trace", str(path), "--out", str(tmp_path / "out"), "--quiet"])
    assert not (tmp_path / "out").exists()


def test_a_recorded_trace_is_named_and_summarised_from_its_own_requests() -> None:
    from bench.generate import PRESETS, generate_trace, trace_stats

    tr = _trace(60)
    assert tr.header.describe() == "recorded trace" and tr.header.stats == {}
    stats = trace_stats(tr)
    assert (stats["requests"], stats["sessions"], stats["prompt_tokens"], stats["duration_s"]) == (1, 1, 900, 1.0)
    assert stats["peak_live_blocks"] == 900 // 32
    generated = generate_trace(PRESETS["fast"], 0, preset="fast")
    assert generated.header.describe() == "fast trace, seed 0"
    assert trace_stats(generated) == generated.header.stats  # the generator writes the same summary
