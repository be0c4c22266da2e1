"""Trace format: JSONL round trip, validation, deterministic expansion, hashing."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings

from bench.trace import (
    ChildSpawned,
    Out,
    Request,
    Seg,
    SessionEnded,
    Tok,
    ToolCallStarted,
    Trace,
    TraceError,
    TraceHeader,
    chain_hashes,
    segment_tokens,
    sort_events,
)
from bench import cli as bench_cli
from bench_strategies import tiny_traces


def _small_trace() -> Trace:
    r0 = Request(0.0, "r0", "a", None, "c0", 0, (Seg("P", 8), Seg("x", 5)), 3, t_done=0.5)
    r1 = Request(
        2.0, "r1", "a", None, "c1", 1, (Seg("P", 8), Seg("x", 5), Out("r0", 3), Tok((7, 8, 9))), 2,
        after="r0", delay_s=1.5, cause="short", t_done=2.4,
    )
    events = sort_events(
        [
            r1,
            r0,
            ToolCallStarted(0.5, "a", "short", "a/0"),
            ChildSpawned(2.4, "a", "a.c0"),
            SessionEnded(2.4, "a"),
        ]
    )
    header = TraceHeader(block_size=4, num_gpu_blocks=9, max_model_len=64, seed=3, params={"k": [1, 2]},
                         shared_prefix={"segment": "P", "tokens": 8, "continuation_id": "cp"})
    return Trace(header, events)


def test_roundtrip_small(tmp_path):
    tr = _small_trace()
    tr.validate()
    path = tmp_path / "t.jsonl"
    tr.save(path)
    back = Trace.load(path)
    assert back.header == tr.header
    assert back.events == tr.events
    assert back.dumps() == tr.dumps()
    first = json.loads(path.read_text().splitlines()[0])
    assert first["format"] == "kvhint-trace" and first["version"] == 1


@settings(max_examples=60, deadline=None)
@given(tiny_traces())
def test_roundtrip_random(tr):
    back = Trace.loads(tr.dumps())
    assert back.events == tr.events
    assert back.header == tr.header
    for r in tr.requests():
        assert back.expand_prompt(r) == tr.expand_prompt(r)


def test_sort_requests_before_signals_at_equal_t():
    evs = sort_events([SessionEnded(1.0, "a"), Request(1.0, "r", "a", None, "c", 0, (Seg("s", 1),), 1)])
    assert [e.kind for e in evs] == ["request", "session_ended"]


def test_version_and_format_checked():
    tr = _small_trace()
    lines = tr.dumps().splitlines()
    hdr = json.loads(lines[0])
    hdr["version"] = 99
    with pytest.raises(ValueError, match="version"):
        Trace.from_lines([json.dumps(hdr), *lines[1:]])
    hdr["format"] = "other"
    with pytest.raises(ValueError):
        Trace.from_lines([json.dumps(hdr), *lines[1:]])


def test_expand_uses_real_outputs():
    tr = _small_trace()
    r1 = tr.request_index()["r1"]
    ids = tr.expand_prompt(r1, outputs={"r0": [100, 101, 102]})
    assert ids[13:16] == [100, 101, 102]
    assert ids[-3:] == [7, 8, 9]
    placeholder = tr.expand_prompt(r1)
    assert placeholder[:13] == ids[:13]
    with pytest.raises(ValueError, match="ignore_eos"):
        tr.expand_prompt(r1, outputs={"r0": [1, 2]})


def test_validate_rejects_bad_traces():
    tr = _small_trace()
    bad = Trace(tr.header, list(reversed(tr.events)))
    with pytest.raises(ValueError):
        bad.validate()
    # output of a later/unknown request
    r = Request(0.0, "r9", "a", None, "c", 0, (Out("nope", 2),), 1)
    with pytest.raises(ValueError, match="unknown"):
        Trace(tr.header, [r]).validate()
    # one segment name, two lengths
    r = Request(0.0, "r9", "a", None, "c", 0, (Seg("P", 8), Seg("P", 9)), 1)
    with pytest.raises(ValueError, match="two lengths"):
        Trace(tr.header, [r]).validate()
    # exceeds max_model_len
    r = Request(0.0, "r9", "a", None, "c", 0, (Seg("big", 64),), 1)
    with pytest.raises(ValueError, match="max_model_len"):
        Trace(tr.header, [r]).validate()


def test_segment_tokens_deterministic_and_in_range():
    a = segment_tokens("hello", 5000)
    b = segment_tokens("hello", 5000)
    assert np.array_equal(a, b)
    assert a.min() >= 3 and a.max() < 4096
    assert not np.array_equal(a[:100], segment_tokens("hellp", 100))


def test_chain_hashes_prefix_property():
    toks = list(segment_tokens("z", 100))
    h = chain_hashes(toks, 8)
    assert len(h) == 100 // 8
    assert chain_hashes(toks[:41], 8) == h[:5]  # partial block ignored
    other = toks[:16] + [5] + toks[17:]
    h2 = chain_hashes(other, 8)
    assert h2[:2] == h[:2] and all(x != y for x, y in zip(h2[2:], h[2:]))
    # same block content at a different position -> different id (chained)
    assert chain_hashes(toks[8:16], 8)[0] != h[1]


# ---------------------------------------------------------------- user-recorded traces


def _lines() -> list[str]:
    return _small_trace().dumps().splitlines()


def test_a_tool_call_without_a_duration_class_is_read_and_written_back_without_one():
    lines = _lines()
    lines.insert(2, json.dumps({"kind": "tool_call_started", "t": 0.5, "session_id": "a", "tool": "pytest"}))
    tr = Trace.from_lines(lines)
    sig = next(e for e in tr.events if isinstance(e, ToolCallStarted) and e.tool == "pytest")
    assert sig.expected_duration_class is None and sig.tool_call_id == ""
    assert "expected_duration_class" not in sig.to_json()
    assert Trace.loads(tr.dumps()).events == tr.events
    explicit_null = Trace.from_lines([*lines[:2], lines[2].replace('"tool"', '"expected_duration_class": null, "tool"')])
    assert explicit_null.events[-1] == sig


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"kind": "request", "t": 1,', r"line 3: not JSON"),
        ('{"kind": "request", "t": 1, "request_id": "x", "session_id": "a", "prompt": []}',
         r"line 3: event has no 'max_tokens' field"),
        ('{"kind": "tool_call_started", "t": 1, "session_id": "a", "expected_duration_class": "medium"}',
         r"line 3: bad event: expected_duration_class 'medium' is not one of \['short', 'long'\]"),
        ('[1, 2]', r"line 3: bad event: an event must be a JSON object, got list"),
        ('{"kind": "request", "t": 1, "request_id": "x", "session_id": "a", "prompt": [5], "max_tokens": 1}',
         r"line 3: bad event: a prompt segment must be an object"),
        ('{"kind": "paused", "t": 1}', r"line 3: bad event: unknown event kind 'paused'"),
        ('{"kind": "session_ended", "t": "soon", "session_id": "a"}', r"line 3: bad event: could not convert"),
    ],
)
def test_a_line_that_breaks_the_format_is_named_by_its_number(tmp_path, line, message):
    lines = _lines()
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join([lines[0], "", line, *lines[1:]]) + "\n")  # the blank line 2 still counts
    with pytest.raises(TraceError, match=message) as info:
        Trace.load(path)
    assert str(info.value).startswith(f"{path}: line 3: ")


def test_header_errors_say_what_line_1_must_be():
    with pytest.raises(TraceError, match="empty trace"):
        Trace.from_lines(["", "  "])
    with pytest.raises(TraceError, match=r'line 1: bad header: line 1 must be the header, \{"format": "kvhint-trace"'):
        Trace.from_lines(_lines()[1:])
    hdr = json.loads(_lines()[0])
    del hdr["block_size"]
    with pytest.raises(TraceError, match="line 1: header has no 'block_size' field"):
        Trace.from_lines([json.dumps(hdr)])


def test_out_of_order_events_name_the_event():
    tr = _small_trace()
    with pytest.raises(TraceError, match=r"events out of order: request r1 at t=2.0 after t=2.4"):
        Trace(tr.header, list(reversed(tr.events))).validate()


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = bench_cli.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_takes_the_trace_as_an_argument_or_as_trace_and_reports_bad_files(tmp_path, capsys):
    tr = _small_trace()
    path = tmp_path / "t.jsonl"
    tr.save(path)
    rc, positional, _ = _cli(["analyze", str(path), "--no-tiers", "--json"], capsys)
    assert rc == 0
    rc, option, _ = _cli(["analyze", "--trace", str(path), "--no-tiers", "--json"], capsys)
    assert rc == 0
    drop_time = lambda text: {k: v for k, v in json.loads(text).items() if k != "seconds"}  # noqa: E731
    assert drop_time(option) == drop_time(positional)
    rc, out, _ = _cli(["policy", "--trace", str(path)], capsys)
    assert rc == 0 and json.loads(out.splitlines()[0])["action"]
    for argv in (["analyze"], ["analyze", str(path), "--trace", str(path)]):
        with pytest.raises(SystemExit) as exit_info:
            bench_cli.main(argv)
        assert exit_info.value.code == 2
        assert "give the trace once, as TRACE or --trace TRACE" in capsys.readouterr().err
    rc, _, err = _cli(["analyze", "--trace", str(tmp_path / "missing.jsonl")], capsys)
    assert rc == 2 and "No such file" in err
    hdr = json.loads(path.read_text().splitlines()[0])
    del hdr["num_gpu_blocks"]
    nopool = tmp_path / "nopool.jsonl"
    nopool.write_text("\n".join([json.dumps(hdr), *path.read_text().splitlines()[1:]]) + "\n")
    rc, _, err = _cli(["analyze", "--trace", str(nopool)], capsys)
    assert rc == 2 and "the header has no num_gpu_blocks" in err and "--num-gpu-blocks N" in err
    rc, _, _ = _cli(["analyze", "--trace", str(nopool), "--num-gpu-blocks", "9", "--no-tiers"], capsys)
    assert rc == 0


@pytest.mark.parametrize(
    "setting,message",
    [
        ("agents=10", "--set agents: unknown parameter (known: "),
        ("concurrency", "--set 'concurrency': expected KEY=JSON"),
        ("num_sessions=abc", "--set num_sessions=abc: the value is not JSON"),
        ("num_sessions=\"12\"", "--set num_sessions=\"12\": expected a value like the preset's 16"),
        ("turns=5", "--set turns=5: expected a value like the preset's ["),
        ("turns=[4,2]", "--set: turns: bad range (4, 2)"),
    ],
)
def test_generate_rejects_a_bad_setting_with_a_message_and_writes_nothing(tmp_path, capsys, setting, message):
    out = tmp_path / "t.jsonl"
    rc, _, err = _cli(["generate", "--preset", "default", "--set", setting, "-o", str(out)], capsys)
    assert rc == 2 and f"python -m bench generate: error: {message}" in err
    assert not out.exists()


def test_generate_takes_json_settings(tmp_path, capsys):
    out = tmp_path / "t.jsonl"
    rc, _, _ = _cli(["generate", "--preset", "fast", "--set", "concurrency=2", "--set", "turns=[2,3]", "-o", str(out)], capsys)
    assert rc == 0
    params = Trace.load(out).header.params
    assert params["concurrency"] == 2 and params["turns"] == [2, 3]
