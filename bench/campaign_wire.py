"""Campaign phase 1: wire fuzz against a served sidecar.

Random messages (every field of the request type, filled from its descriptor
with edge values), crafted page tokens (unsigned JSON with wrong-typed or
negative offsets, truncated and bit-flipped genuine tokens, 5,000-character
tokens), oversized ids and plain garbage bytes, sent as raw unary calls over
all six RPCs. A call fails the contract when it answers UNKNOWN, INTERNAL or
RESOURCE_EXHAUSTED (an unchecked size reaching gRPC's limits), and the phase
fails if the engine stops serving (checked every 100 calls and at the end: a
GetCapabilities in the same epoch and a completion).
"""

from __future__ import annotations

import base64
import json
import random
import time
from typing import Any

import grpc
from google.protobuf import descriptor as pb_descriptor
from google.protobuf import message as pb_message

from engine_integration.served import ServedEngine
from kvhint.v1 import kvhint_pb2 as pb
from kvhint_client.openai_traffic import complete

from .campaign_model import PhaseResult, session_selector, tokens

SERVICE = "/kvhint.v1.KvHintService/"
REQUESTS: dict[str, type[pb_message.Message]] = {
    "GetCapabilities": pb.GetCapabilitiesRequest,
    "ApplyHints": pb.ApplyHintsRequest,
    "QueryResidency": pb.QueryResidencyRequest,
    "ListSessions": pb.ListSessionsRequest,
    "WatchEvents": pb.WatchEventsRequest,
    "GetOperation": pb.GetOperationRequest,
}
FORBIDDEN = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.RESOURCE_EXHAUSTED}
FD = pb_descriptor.FieldDescriptor
_INTS = [0, 1, -1, 7, 2**31 - 1, -(2**31), 2**32 - 1, 2**63 - 1]


def _text(rng: random.Random) -> str:
    return rng.choice(["", "s0", "x" * rng.choice([1, 257, 5000]), "\u00e9\u4e2d\U0001f600", "../../etc", "a\x00b"])


def _scalar(field: pb_descriptor.FieldDescriptor, rng: random.Random, big: bool) -> Any:
    """An edge value for `field`; 5,000-byte strings and bytes only when `big`
    (one field, not every element of a 300-element list: that would pass the
    4 MB message limit and test gRPC, not the server)."""
    t = field.type
    if t == FD.TYPE_STRING:
        return _text(rng) if big else rng.choice(["", "s0", "\u00e9"])
    if t == FD.TYPE_BYTES:
        return rng.randbytes(rng.choice([0, 1, 31, 32, 33, 5000] if big else [0, 31, 32]))
    if t == FD.TYPE_BOOL:
        return rng.random() < 0.5
    if t in (FD.TYPE_DOUBLE, FD.TYPE_FLOAT):
        return rng.choice([0.0, -1.0, 1e30, float("nan"), float("inf")])
    if t == FD.TYPE_ENUM:
        return rng.choice([0, 1, 2, 3, 99, -1])
    value = rng.choice(_INTS)
    if t in (FD.TYPE_UINT32, FD.TYPE_FIXED32):
        return abs(value) % 2**32
    if t in (FD.TYPE_UINT64, FD.TYPE_FIXED64):
        return abs(value)
    if t in (FD.TYPE_INT32, FD.TYPE_SINT32, FD.TYPE_SFIXED32):
        return max(-(2**31), min(2**31 - 1, value))
    return value


def fill(msg: pb_message.Message, rng: random.Random, depth: int = 0) -> pb_message.Message:
    """Set a random subset of `msg`'s fields (recursively, 3 levels) to edge values."""
    for field in msg.DESCRIPTOR.fields:
        if rng.random() < 0.4:
            continue
        repeated = field.is_repeated
        count = rng.choice([0, 1, 3, 300 if depth else 2]) if repeated else 1
        for _ in range(count):
            if field.type == FD.TYPE_MESSAGE:
                if depth >= 3 or field.message_type.GetOptions().map_entry:
                    break
                child = getattr(msg, field.name).add() if repeated else getattr(msg, field.name)
                if not repeated:
                    child.SetInParent()
                fill(child, rng, depth + 1)
            elif repeated:
                getattr(msg, field.name).append(_scalar(field, rng, big=count < 300))
            else:
                setattr(msg, field.name, _scalar(field, rng, big=True))
    return msg


def crafted_token(rng: random.Random, epoch: str, genuine: list[str]) -> str:
    odd = rng.choice([-1, "x", None, 1.5, [1], True, 2**70])
    payload = {"e": epoch, "s": rng.choice(["", "s", "\u00e9"]), rng.choice(["o", "a"]): odd}
    forms = [
        lambda: base64.urlsafe_b64encode(json.dumps(payload).encode()).decode(),
        lambda: "A" * 5000,
        lambda: rng.randbytes(40).hex(),
    ]
    if genuine:
        token = rng.choice(genuine)
        cut = rng.randrange(len(token))
        forms += [lambda: token[:cut], lambda: token[:cut] + chr(rng.randrange(33, 127)) + token[cut + 1 :]]
    return str(rng.choice(forms)())


def request_bytes(method: str, rng: random.Random, epoch: str, genuine: list[str]) -> tuple[str, bytes]:
    """(form, serialized request) for one fuzz call."""
    form = rng.choice(["random", "random", "crafted", "garbage"])
    if form == "garbage":
        return form, rng.randbytes(rng.choice([1, 7, 80, 4000]))
    msg = fill(REQUESTS[method](), rng)
    if form == "crafted":
        if method in ("QueryResidency", "ListSessions"):
            msg.page_token = crafted_token(rng, epoch, genuine)  # type: ignore[attr-defined]
        elif method == "GetOperation":
            msg.operation_id = "o" * rng.choice([257, 5000, 100_000])  # type: ignore[attr-defined]
        elif method == "ApplyHints":
            hint = msg.hints.add()  # type: ignore[attr-defined]
            hint.hint_id = "h" * rng.choice([129, 5000])
            hint.selector.CopyFrom(session_selector("s" * rng.choice([257, 5000])))
            hint.evict.SetInParent()
        elif method == "WatchEvents":
            msg.resume_epoch = "e" * rng.choice([257, 5000])  # type: ignore[attr-defined]
            msg.start = pb.WatchEventsRequest.START_RESUME  # type: ignore[attr-defined]
    return form, msg.SerializeToString()


def call(channel: grpc.Channel, method: str, raw: bytes) -> grpc.StatusCode:
    """One raw call; OK, or the status it failed with. WatchEvents is read for 0.25 s."""
    try:
        if method == "WatchEvents":
            for _ in channel.unary_stream(SERVICE + method)(raw, timeout=0.25):
                pass
        else:
            channel.unary_unary(SERVICE + method)(raw, timeout=15)
    except grpc.RpcError as err:
        code = err.code()
        if method == "WatchEvents" and code is grpc.StatusCode.DEADLINE_EXCEEDED:
            return grpc.StatusCode.OK  # our own read window ended
        return code  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def still_serving(engine: ServedEngine, stub: Any, epoch: str) -> str | None:
    """None when the engine answers in the same epoch and completes a request; else why not."""
    try:
        now = stub.GetCapabilities(pb.GetCapabilitiesRequest(), timeout=10).epoch
        complete(engine.http_url, tokens("fuzz-alive", 64), session_id="fuzz-alive", timeout=60)
    except Exception as exc:  # noqa: BLE001 - any failure means it stopped serving
        return f"stopped serving: {exc!r}"[:300]
    return None if now == epoch else f"epoch changed during fuzz: {epoch} -> {now}"


def genuine_tokens(stub: Any) -> list[str]:
    page = stub.ListSessions(pb.ListSessionsRequest(page_size=1), timeout=10)
    return [page.next_page_token] if page.next_page_token else []


def run(engine: ServedEngine, calls: int, seed: int = 14) -> PhaseResult:
    from kvhint.v1 import kvhint_pb2_grpc as pbg

    result = PhaseResult("wire fuzz")
    rng = random.Random(seed)
    for i in range(4):  # something to page through
        complete(engine.http_url, tokens(f"fuzz-{i}", 96), session_id=f"fuzz-s{i}")
    codes: dict[str, int] = {}
    t0 = time.monotonic()
    with grpc.insecure_channel(engine.grpc_address) as channel:
        stub = pbg.KvHintServiceStub(channel)
        epoch = stub.GetCapabilities(pb.GetCapabilitiesRequest(), timeout=10).epoch
        genuine = genuine_tokens(stub)
        methods = sorted(REQUESTS)
        for i in range(calls):
            method = methods[i % len(methods)]
            form, raw = request_bytes(method, rng, epoch, genuine)
            code = call(channel, method, raw)
            result.tried += 1
            codes[code.name] = codes.get(code.name, 0) + 1
            if code in FORBIDDEN:
                result.fail(f"{method} ({form}, {len(raw)} bytes): {code.name}")
            if (i + 1) % 100 == 0 and (why := still_serving(engine, stub, epoch)):
                result.fail(why)
                break
        if why := still_serving(engine, stub, epoch):
            result.fail(why)
    result.details = {"calls": result.tried, "seconds": round(time.monotonic() - t0, 1), "status_codes": codes}
    result.notes = f"{len(REQUESTS)} RPCs; status codes {codes}; engine kept serving in the same epoch" if not result.failures else "; ".join(result.failures[:3])
    return result
