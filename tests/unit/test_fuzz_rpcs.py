"""Wire fuzz over all six KvHintService RPCs against a real in-process server.

The server is the real grpc.aio KvHintServer over the engine-neutral core and
a FakeEngine that holds a few sessions (so pages and tokens exist). Requests
are random messages built from the proto descriptors (every field, random
values including unknown enum numbers, out-of-range durations, over-long ids),
crafted page tokens (unsigned JSON with wrong types, negative offsets, tampered
genuine tokens, tokens of another epoch) and raw random bytes. Whatever comes
in, the answer is never UNKNOWN, INTERNAL or RESOURCE_EXHAUSTED, every error
carries ErrorInfo and a short message, and afterwards GetCapabilities and a
valid ApplyHints still succeed (the engine thread is still serving).
"""

from __future__ import annotations

import base64
import json
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor as pb_descriptor
from google.protobuf import message as pb_message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvhint_unit_support import Harness, error_info, h, pin

from kvhint.v1 import kvhint_pb2 as pb
from kvhint_server.page_tokens import PageTokens

REQUESTS: dict[str, type[pb_message.Message]] = {
    "GetCapabilities": pb.GetCapabilitiesRequest,
    "ApplyHints": pb.ApplyHintsRequest,
    "QueryResidency": pb.QueryResidencyRequest,
    "ListSessions": pb.ListSessionsRequest,
    "GetOperation": pb.GetOperationRequest,
    "WatchEvents": pb.WatchEventsRequest,
}
FORBIDDEN = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.RESOURCE_EXHAUSTED}
# A failed RPC's message: fixed text plus at most a short excerpt of input.
MAX_MESSAGE_CHARS = 300
FD = pb_descriptor.FieldDescriptor

_text = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["s0", "s1", "s", "c0", "peer-b", ""]),
    st.integers(200, 6000).map(lambda n: "x" * n),  # past every id limit
)
_INT_RANGES = {
    FD.TYPE_INT32: (-(2**31), 2**31 - 1), FD.TYPE_SINT32: (-(2**31), 2**31 - 1), FD.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FD.TYPE_UINT32: (0, 2**32 - 1), FD.TYPE_FIXED32: (0, 2**32 - 1),
    FD.TYPE_INT64: (-(2**63), 2**63 - 1), FD.TYPE_SINT64: (-(2**63), 2**63 - 1), FD.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FD.TYPE_UINT64: (0, 2**64 - 1), FD.TYPE_FIXED64: (0, 2**64 - 1),
}


def _scalar(field: pb_descriptor.FieldDescriptor) -> st.SearchStrategy[Any]:
    if field.type == FD.TYPE_STRING:
        return _text
    if field.type == FD.TYPE_BYTES:
        return st.one_of(st.binary(max_size=70), st.sampled_from([h(1), h(2), h(3)]))
    if field.type == FD.TYPE_BOOL:
        return st.booleans()
    if field.type in (FD.TYPE_DOUBLE, FD.TYPE_FLOAT):
        return st.floats(allow_nan=True, allow_infinity=True, width=32)
    if field.type == FD.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), st.integers(-3, 40))  # open enums: unknown numbers too
    lo, hi = _INT_RANGES[field.type]
    return st.one_of(st.integers(-2, 5).filter(lambda v: lo <= v <= hi), st.integers(lo, hi))


def _fill(msg: pb_message.Message, data: st.DataObject, depth: int) -> None:
    """Set a random subset of `msg`'s fields to random values (oneofs: at most one)."""
    for field in msg.DESCRIPTOR.fields:
        if not data.draw(st.booleans()):
            continue
        repeated = field.is_repeated
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            continue  # no map fields in requests today
        count = data.draw(st.integers(0, 3)) if repeated else 1
        for _ in range(count):
            if field.type == FD.TYPE_MESSAGE:
                if depth <= 0:
                    break
                if repeated:
                    _fill(getattr(msg, field.name).add(), data, depth - 1)
                else:
                    _fill(getattr(msg, field.name), data, depth - 1)
                    getattr(msg, field.name).SetInParent()
            elif repeated:
                getattr(msg, field.name).append(data.draw(_scalar(field)))
            else:
                setattr(msg, field.name, data.draw(_scalar(field)))


def random_message(cls: type[pb_message.Message], data: st.DataObject) -> pb_message.Message:
    msg = cls()
    _fill(msg, data, depth=5)
    return msg


def _unsigned(payload: dict[str, Any]) -> str:
    """A page token as the old format spelled it: base64 JSON, no MAC."""
    return base64.urlsafe_b64encode(json.dumps(payload).encode()).decode()


def crafted_tokens(harness: Harness, genuine: list[str]) -> st.SearchStrategy[str]:
    epoch = harness.core.bus.epoch
    values = st.one_of(st.integers(-5, 10), st.text(max_size=5), st.booleans(), st.none(), st.floats(), st.just([1]))
    other_epoch = PageTokens(epoch)  # same epoch string, another key
    return st.one_of(
        st.fixed_dictionaries({"e": st.just(epoch), "s": st.text(max_size=16), "o": values, "a": values}).map(_unsigned),
        st.sampled_from(genuine),
        # (a string field holds Unicode text: a lone surrogate cannot be serialized by any client;
        # malformed UTF-8 on the wire is the "bytes" form's)
        st.tuples(st.sampled_from(genuine), st.integers(0, 200), st.characters(codec="utf-8")).map(
            lambda t: t[0][: t[1]] + t[2] + t[0][t[1] + 1 :]
        ),
        st.tuples(st.text(max_size=8), values).map(lambda t: other_epoch.issue(t[0], "o", t[1])),
        st.text(max_size=40),
        st.integers(2000, 6000).map(lambda n: "A" * n),
    )


def _call(harness: Harness, method: str, raw: bytes) -> grpc.RpcError | None:
    """One call with serialized `raw`; WatchEvents is read for a moment."""
    try:
        if method == "WatchEvents":
            stream = harness.channel.unary_stream(f"/kvhint.v1.KvHintService/{method}")(raw, timeout=0.1)
            for _ in stream:
                pass
        else:
            harness.raw(method)(raw, timeout=10)
    except grpc.RpcError as err:
        return err
    return None


def check_answer(method: str, err: grpc.RpcError | None) -> None:
    if err is None:
        return
    code = err.code()
    if method == "WatchEvents" and code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return  # our own read window ended
    assert code not in FORBIDDEN, (method, code, err.details())
    assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), (method, code, err.details())
    assert len(err.details() or "") <= MAX_MESSAGE_CHARS, (method, len(err.details()))
    info = error_info(err)
    assert info is not None and info.domain == "kvhint.v1", (method, err.details())


def assert_still_serving(harness: Harness) -> None:
    caps = harness.stub.GetCapabilities(pb.GetCapabilitiesRequest(), timeout=5)
    assert caps.epoch == harness.core.bus.epoch
    harness.engine.store([h(900)], session="alive")
    result = harness.apply(pin("alive", 5)).results[0]
    assert result.outcome in (pb.OUTCOME_ACCEPTED, pb.OUTCOME_CLIPPED), result


@pytest.fixture
def populated(make_harness) -> tuple[Harness, list[str]]:
    """A server holding 12 sessions of 3 blocks, and genuine page tokens."""
    harness = make_harness(default_page_size=2, max_page_size=4)
    for i in range(12):
        harness.engine.store([h(100 + 3 * i), h(101 + 3 * i), h(102 + 3 * i)], session=f"s{i}", continuation=f"c{i}")
    genuine = [
        harness.stub.ListSessions(pb.ListSessionsRequest(), timeout=5).next_page_token,
        harness.stub.QueryResidency(
            pb.QueryResidencyRequest(selector=pb.Selector(session=pb.SessionSelector(session_id="s0")), page_size=1),
            timeout=5,
        ).next_page_token,
    ]
    assert all(genuine)
    return harness, genuine


def test_fuzz_all_six_rpcs_never_fail_internally_and_the_server_keeps_serving(populated):
    harness, genuine = populated
    methods_seen: set[str] = set()

    @settings(max_examples=260, deadline=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data(), method=st.sampled_from(sorted(REQUESTS)), form=st.sampled_from(["message", "token", "bytes"]))
    def run(data: st.DataObject, method: str, form: str) -> None:
        if form == "bytes":
            raw = data.draw(st.binary(max_size=80))
        else:
            msg = random_message(REQUESTS[method], data)
            if form == "token" and method in ("QueryResidency", "ListSessions"):
                msg.page_token = data.draw(crafted_tokens(harness, genuine))  # type: ignore[attr-defined]
            raw = msg.SerializeToString()
        methods_seen.add(method)
        check_answer(method, _call(harness, method, raw))

    run()
    assert methods_seen == set(REQUESTS)
    assert_still_serving(harness)
    assert harness.engine.violations == []
