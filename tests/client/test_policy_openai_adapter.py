"""OpenAITrafficAdapter: the signals a router derives from recorded chat-completions traffic
(non-streaming and streaming), seen through the hints the policy sends."""

from __future__ import annotations

import pytest

from kvhint_client.policy import (
    OpenAITrafficAdapter,
    RecordingSink,
    SessionPolicy,
    default_session_of,
    engine_session_of,
    parse_sse_line,
    upstream_headers,
)
from kvhint_client.policy.signals import ChildSpawned, RequestCompleted, RequestSent, SessionEnded, ToolCallStarted

REQUEST = {"model": "m", "messages": [{"role": "user", "content": "fix the test"}], "tools": [{"type": "function"}]}
TOOL_RESPONSE = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "choices": [{
        "index": 0,
        "finish_reason": "tool_calls",
        "message": {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "run_tests", "arguments": "{}"}},
            {"id": "call_2", "type": "function", "function": {"name": "grep", "arguments": "{\"q\": \"x\"}"}},
        ]},
    }],
}
STOP_RESPONSE = {"choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "Done. <END>"}}]}
SSE = [
    b'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}',
    b"",
    b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"c1","function":{"name":"web_search","arguments":""}}]}}]}',
    b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\\"q\\":1}"}}]}}]}',
    b": keep-alive comment",
    b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}',
    b"data: [DONE]",
]


class Recorder(SessionPolicy):
    """A SessionPolicy that also keeps every signal it was given."""

    def __init__(self) -> None:
        super().__init__(clock=lambda: 0.0, id_prefix="h")
        self.signals: list[object] = []

    def observe(self, signal):  # type: ignore[no-untyped-def]
        self.signals.append(signal)
        super().observe(signal)


def test_tool_calls_response_starts_a_pause_named_by_the_tools() -> None:
    policy = Recorder()
    adapter = OpenAITrafficAdapter(policy)
    sid = adapter.on_request(REQUEST, {"X-Session-ID": "agent-7"}, t=1.0)
    adapter.on_response(sid, TOOL_RESPONSE, t=2.0)
    assert policy.signals == [RequestSent("agent-7", t=1.0), ToolCallStarted("agent-7", tools=("run_tests", "grep"), t=2.0)]
    sink = RecordingSink()
    policy.flush(sink, 2.0)
    assert [h.WhichOneof("action") for h in sink.hints] == ["retain"]
    # The next request of the session ends the pause, and the gap is learned per tool set.
    adapter.on_request(REQUEST, {"x-session-id": "agent-7"}, t=9.0)
    assert policy.model.count(("tool", "grep+run_tests")) == 1


def test_streaming_tool_call_is_recognised() -> None:
    policy = Recorder()
    adapter = OpenAITrafficAdapter(policy)
    sid = adapter.on_request({**REQUEST, "stream": True, "session_id": "s1"}, t=0.0)
    for line in SSE:
        chunk = parse_sse_line(line)
        if chunk is not None:
            adapter.on_stream_chunk(sid, chunk)
    adapter.on_stream_end(sid, t=0.5)
    assert policy.signals[-1] == ToolCallStarted("s1", tools=("web_search",), t=0.5)


def test_end_marker_and_end_tools_end_the_session() -> None:
    policy = Recorder()
    adapter = OpenAITrafficAdapter(policy, end_marker="<END>", end_tools=("submit",))
    sid = adapter.on_request({**REQUEST, "user": "u1"}, t=0.0)
    adapter.on_response(sid, STOP_RESPONSE, t=1.0)
    assert policy.signals[-1] == SessionEnded("u1", t=1.0)
    submit = {"choices": [{"finish_reason": "tool_calls", "message": {"tool_calls": [{"function": {"name": "submit"}}]}}]}
    sid = adapter.on_request({**REQUEST, "user": "u2"}, t=2.0)
    adapter.on_response(sid, submit, t=3.0)
    assert policy.signals[-1] == SessionEnded("u2", t=3.0)
    sink = RecordingSink()
    policy.flush(sink, 3.0)
    assert sorted(h.selector.session.session_id for h in sink.hints if h.HasField("release")) == ["u1", "u2"]


def test_plain_answer_is_an_idle_pause_and_idle_timeout_ends_the_session() -> None:
    policy = Recorder()
    adapter = OpenAITrafficAdapter(policy, idle_timeout_s=60)
    sid = adapter.on_request(REQUEST, {"X-Session-ID": "s"}, t=0.0)
    adapter.on_response(sid, {"choices": [{"finish_reason": "stop", "message": {"content": "hi"}}]}, t=1.0)
    assert policy.signals[-1] == RequestCompleted("s", t=1.0)
    assert adapter.tick(t=30.0) == []
    assert adapter.tick(t=61.0) == ["s"]
    assert policy.signals[-1] == SessionEnded("s", t=61.0)


def test_child_session_is_spawned_from_its_parent_header() -> None:
    policy = Recorder()
    adapter = OpenAITrafficAdapter(policy)
    adapter.on_request(REQUEST, {"X-Session-ID": "p"}, t=0.0)
    adapter.on_request(REQUEST, {"X-Session-ID": "p.c0", "X-Parent-Session-ID": "p"}, t=1.0)
    adapter.on_request({**REQUEST, "vllm_xargs": {"parent_session_id": "p"}, "session_id": "p.c1"}, t=1.0)
    adapter.on_request(REQUEST, {"X-Session-ID": "p.c0", "X-Parent-Session-ID": "p"}, t=2.0)  # not a new child
    spawned = [s for s in policy.signals if isinstance(s, ChildSpawned)]
    assert spawned == [ChildSpawned("p", "p.c0", t=1.0), ChildSpawned("p", "p.c1", t=1.0)]


def test_requests_without_a_session_are_ignored() -> None:
    policy = Recorder()
    adapter = OpenAITrafficAdapter(policy)
    sid = adapter.on_request(REQUEST, {}, t=0.0)
    adapter.on_response(sid, TOOL_RESPONSE, t=1.0)
    assert sid is None and policy.signals == []


# --------------------------------------------------------------------------- which session, which class


def test_session_ids_are_read_in_vllms_order_and_user_is_a_router_only_fallback() -> None:
    body, header, xargs = {"session_id": "body"}, {"X-Session-ID": "header"}, {"vllm_xargs": {"session_id": "xargs"}}
    assert engine_session_of({**body, **xargs}, header) == "body"  # vLLM: body, then header, then vllm_xargs
    assert engine_session_of(xargs, header) == "header"
    assert engine_session_of({**xargs, "user": "u"}, {}) == "xargs"
    assert engine_session_of({"user": "u"}, {}) is None  # vLLM does not read "user"
    assert default_session_of({"user": "u"}, {}) == "u"
    assert default_session_of({**body, "user": "u"}, header) == "body"


def test_a_proxy_forwards_a_user_keyed_session_with_the_header_the_engine_reads() -> None:
    headers = {"Authorization": "Bearer t", "x-session-id": ""}
    out = upstream_headers({"user": "u1"}, headers, "u1")
    assert out["X-Session-ID"] == "u1" and out["Authorization"] == "Bearer t" and "x-session-id" not in out
    assert engine_session_of({"user": "u1"}, out) == "u1"
    same = {"X-Session-ID": "s"}
    assert upstream_headers({}, same, "s") == same and upstream_headers({}, same, None) == same
    with pytest.raises(ValueError, match="body names session 'b'"):
        upstream_headers({"session_id": "b"}, {}, "router-id")


def test_the_session_class_header_keys_the_pauses_of_its_class() -> None:
    policy = Recorder()
    adapter = OpenAITrafficAdapter(policy)
    sid = adapter.on_request(REQUEST, {"X-Session-ID": "a", "X-Session-Class": "coder"}, t=0.0)
    assert policy.signals[-1] == RequestSent("a", session_class="coder", t=0.0)
    adapter.on_response(sid, TOOL_RESPONSE, t=1.0)
    adapter.on_request(REQUEST, {"X-Session-ID": "a"}, t=5.0)
    assert policy.model.count(("tool", "grep+run_tests", "coder")) == 1


def test_a_failed_request_leaves_its_session_idle_not_running() -> None:
    policy = Recorder()
    adapter = OpenAITrafficAdapter(policy)
    sid = adapter.on_request(REQUEST, {"X-Session-ID": "a"}, t=0.0)
    adapter.on_error(sid, t=1.0)
    assert policy.signals[-1] == RequestCompleted("a", t=1.0)
    sink = RecordingSink()
    policy.flush(sink, 1.0)
    assert [h.WhichOneof("action") for h in sink.hints] == ["retain"]
    adapter.on_error(None, t=2.0)  # untracked request: nothing
    assert len(policy.signals) == 2


def test_a_parent_waiting_on_its_working_sub_agent_is_not_idle() -> None:
    """The idle timeout ended a parent whose child had worked longer than it, and releasing the
    parent released the working child with it. A child's request is the parent's activity."""
    policy = Recorder()
    adapter = OpenAITrafficAdapter(policy, idle_timeout_s=600)
    adapter.on_request(REQUEST, {"X-Session-ID": "p"}, t=0.0)
    for t in range(2, 1200, 60):  # the sub-agent works for 20 minutes
        adapter.on_request(REQUEST, {"X-Session-ID": "p.c", "X-Parent-Session-ID": "p"}, t=float(t))
        assert adapter.tick(t=t + 6.0) == [], f"idle-ended at t={t + 6}"
    assert not [s for s in policy.signals if isinstance(s, SessionEnded)]
    assert sorted(adapter.tick(t=1800.0)) == ["p", "p.c"], "both idle once the child stops"
