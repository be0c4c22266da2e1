"""Wire validation and bounds (validation.py) over arbitrary kvhint.v1 messages.

An independent oracle, written from the proto comments, lists every reason a
hint may be rejected for; the validator must reject exactly the hints the
oracle finds a problem with, with one of those reasons, and must never fail a
whole request for a per-hint problem.
"""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import duration_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvhint_unit_support import error_info, local_engine_info

from kvhint.v1 import kvhint_pb2 as pb
from kvhint_server.config import ServerConfig
from kvhint_server.errors import RpcError
from kvhint_server.model import (
    Action,
    ActionSupport,
    EngineInfo,
    HintResult,
    HintSpec,
    Outcome,
    Reason,
    SelectorKind,
    Tier,
    TierInfo,
)
from kvhint_server.validation import parse_apply_request


def items_of(request, config, info):
    """Each hint's validated spec or rejection, in request order."""
    return [p.item for p in parse_apply_request(request, config, info)]

CONFIG = ServerConfig(
    max_ttl_s=600.0,
    max_hints_per_batch=6,
    max_id_length=16,
    max_hint_id_length=12,
    max_block_hashes_per_selector=4,
)
LOCAL = local_engine_info()
# A second engine: everything supported except some selector/range combinations.
FULL = EngineInfo(
    engine="fake",
    engine_version="0",
    block_size=16,
    num_device_blocks=100,
    block_hash_encoding="sha256",
    tiers=(TierInfo(Tier.DEVICE, "GPU"), TierInfo(Tier.HOST, "CPU")),
    actions=(
        ActionSupport(Action.RETAIN, True, (SelectorKind.SESSION, SelectorKind.CONTINUATION, SelectorKind.BLOCK_HASHES), True),
        ActionSupport(Action.PIN, True, (SelectorKind.SESSION, SelectorKind.CONTINUATION), False),
        ActionSupport(Action.RELEASE, True, (SelectorKind.SESSION,), True),
        ActionSupport(Action.EVICT, True, (SelectorKind.BLOCK_HASHES, SelectorKind.SESSION), False),
        ActionSupport(Action.DEMOTE, True, (SelectorKind.SESSION, SelectorKind.CONTINUATION), True),
        ActionSupport(Action.PREFETCH, True, (SelectorKind.SESSION,), False),
        ActionSupport(Action.SHARE, True, (SelectorKind.SESSION, SelectorKind.BLOCK_HASHES), False),
    ),
    share_destinations=("peer-1:50151",),
)
ACTION_OF = {
    "retain": Action.RETAIN, "pin": Action.PIN, "release": Action.RELEASE, "evict": Action.EVICT,
    "demote": Action.DEMOTE, "prefetch": Action.PREFETCH, "share": Action.SHARE,
}
KIND_OF = {"session": SelectorKind.SESSION, "continuation": SelectorKind.CONTINUATION, "block_hashes": SelectorKind.BLOCK_HASHES}
DURATION_MAX_S = 315_576_000_000

# --------------------------------------------------------------------------- strategies

# Each generated hint is clean, or has a few deliberately broken parts.
PARTS = ["hint_id", "selector", "target", "id", "hashes", "range", "action", "ttl", "destination", "tier"]

good_id = st.text(alphabet="abcdefghij-_:0123456789", min_size=1, max_size=8)
bad_id = st.one_of(
    st.just(""),
    st.text(alphabet="é€𝄞a", min_size=3, max_size=8),  # multi-byte: the byte length matters
    st.text(min_size=13, max_size=30),
)
good_duration = st.builds(duration_pb2.Duration, seconds=st.integers(0, 2000), nanos=st.integers(0, 999_999_999))
bad_duration = st.builds(
    duration_pb2.Duration,
    seconds=st.one_of(
        st.integers(-5, 5), st.integers(-(2**63), 2**63 - 1),
        st.sampled_from([DURATION_MAX_S, DURATION_MAX_S + 1, -DURATION_MAX_S - 1]),
    ),
    nanos=st.one_of(st.just(0), st.integers(-999_999_999, 999_999_999), st.integers(-(2**31), 2**31 - 1)),
)
good_hash = st.binary(min_size=1, max_size=64)
any_hash = st.one_of(good_hash, st.just(b""), st.binary(min_size=65, max_size=70))


@st.composite
def selectors(draw: st.DrawFn, broken: frozenset[str] = frozenset()) -> pb.Selector:
    sel = pb.Selector()
    target = draw(st.sampled_from(["session", "continuation", "block_hashes"]))
    if "target" in broken and draw(st.booleans()):
        target = None
    ident = draw(bad_id if "id" in broken else good_id)
    if target == "session":
        sel.session.session_id = ident
        sel.session.include_children = draw(st.booleans())
    elif target == "continuation":
        sel.continuation.continuation_id = ident
    elif target == "block_hashes":
        if "hashes" in broken:
            sel.block_hashes.block_hashes.extend(draw(st.lists(any_hash, max_size=6)))
            sel.block_hashes.SetInParent()
        else:
            sel.block_hashes.block_hashes.extend(draw(st.lists(good_hash, min_size=1, max_size=6)))
    if "range" in broken or draw(st.integers(0, 4)) == 0:
        sel.range.start = draw(st.integers(0, 5))
        choice = draw(st.integers(0, 2))
        if choice == 0:
            sel.range.end = draw(st.integers(0, 6) if "range" in broken else st.integers(sel.range.start + 1, 9))
        elif choice == 1:
            sel.range.SetInParent()
    return sel


@st.composite
def hints(draw: st.DrawFn) -> pb.Hint:
    broken = frozenset(draw(st.one_of(st.just(set()), st.sets(st.sampled_from(PARTS), min_size=1, max_size=3))))
    hint = pb.Hint(hint_id=draw(st.one_of(st.just(""), good_id, bad_id) if "hint_id" in broken else st.one_of(st.just(""), good_id)))
    hint.max_blocks = draw(st.one_of(st.just(0), st.integers(0, 2**32 - 1)))
    if not ("selector" in broken and draw(st.booleans())):
        hint.selector.CopyFrom(draw(selectors(broken)))
    if "action" in broken and draw(st.booleans()):
        return hint
    ttl = bad_duration if "ttl" in broken else good_duration
    action = draw(st.sampled_from(list(ACTION_OF)))
    if action == "retain":
        hint.retain.priority = draw(st.integers(-(2**31), 2**31 - 1))
        if "ttl" in broken and draw(st.booleans()):
            hint.retain.SetInParent()  # no ttl
        else:
            hint.retain.ttl.CopyFrom(draw(ttl))
    elif action == "pin":
        if "ttl" in broken and draw(st.booleans()):
            hint.pin.SetInParent()
        else:
            hint.pin.ttl.CopyFrom(draw(ttl))
    elif action == "release":
        hint.release.SetInParent()
    elif action == "evict":
        hint.evict.SetInParent()
    elif action == "demote":
        hint.demote.target_tier = draw(st.integers(0, 6) if "tier" in broken else st.sampled_from([0, 2]))
    elif action == "prefetch":
        hint.prefetch.SetInParent()
        if draw(st.booleans()):
            hint.prefetch.deadline.CopyFrom(draw(ttl))
    elif action == "share":
        hint.share.destination = draw(st.one_of(good_id, bad_id) if "destination" in broken else st.just("peer-1:50151"))
    return hint


# --------------------------------------------------------------------------- oracle


def _duration_problem(d: duration_pb2.Duration) -> bool:
    if not -999_999_999 <= d.nanos <= 999_999_999:
        return True
    return (d.seconds > 0 and d.nanos < 0) or (d.seconds < 0 and d.nanos > 0)


def _secs(d: duration_pb2.Duration) -> float:
    return d.seconds + d.nanos / 1e9


def _bad_id(value: str, limit: int) -> bool:
    return not value or len(value.encode()) > limit


def oracle(hint: pb.Hint, info: EngineInfo) -> set[Reason]:
    """Every reason this hint could be rejected for (empty: it is valid)."""
    problems: set[Reason] = set()
    if len(hint.hint_id.encode()) > CONFIG.max_hint_id_length:
        problems.add(Reason.INVALID_HINT)
    which = hint.WhichOneof("action")
    if which is None:
        problems.add(Reason.INVALID_HINT)
    kind = None
    sel = hint.selector
    if not hint.HasField("selector") or sel.WhichOneof("target") is None:
        problems.add(Reason.INVALID_HINT)
    else:
        kind = KIND_OF[sel.WhichOneof("target")]
        if sel.HasField("range"):
            if kind is SelectorKind.BLOCK_HASHES:
                problems.add(Reason.INVALID_HINT)
            if sel.range.HasField("end") and sel.range.end <= sel.range.start:
                problems.add(Reason.INVALID_HINT)
        if kind is SelectorKind.SESSION and _bad_id(sel.session.session_id, CONFIG.max_id_length):
            problems.add(Reason.INVALID_HINT)
        if kind is SelectorKind.CONTINUATION and _bad_id(sel.continuation.continuation_id, CONFIG.max_id_length):
            problems.add(Reason.INVALID_HINT)
        if kind is SelectorKind.BLOCK_HASHES:
            hs = sel.block_hashes.block_hashes
            if not hs or len(hs) > CONFIG.max_block_hashes_per_selector or any(not 1 <= len(x) <= 64 for x in hs):
                problems.add(Reason.INVALID_HINT)
    if which is not None and kind is not None:
        action = ACTION_OF[which]
        entry = next(a for a in info.actions if a.action is action)
        if not entry.supported or kind not in entry.selectors:
            problems.add(Reason.UNSUPPORTED)
        has_range = sel.HasField("range") and (sel.range.start > 0 or sel.range.HasField("end"))
        if has_range and not entry.supports_range:
            problems.add(Reason.UNSUPPORTED)
    if which in ("retain", "pin"):
        msg = getattr(hint, which)
        if not msg.HasField("ttl") or _duration_problem(msg.ttl) or _secs(msg.ttl) <= 0:
            problems.add(Reason.INVALID_HINT)
    elif which == "prefetch" and hint.prefetch.HasField("deadline"):
        if _duration_problem(hint.prefetch.deadline) or _secs(hint.prefetch.deadline) <= 0:
            problems.add(Reason.INVALID_HINT)
    elif which == "share":
        dest = hint.share.destination
        if _bad_id(dest, CONFIG.max_id_length):
            problems.add(Reason.INVALID_HINT)
        elif dest not in info.share_destinations:
            problems.add(Reason.UNKNOWN_DESTINATION)
    elif which == "demote" and hint.demote.target_tier:
        lower = {int(t.tier) for t in info.tiers if t.tier is not Tier.DEVICE}
        if hint.demote.target_tier not in {int(t) for t in Tier} - {int(Tier.DEVICE)}:
            problems.add(Reason.INVALID_HINT)  # the device, or no tier at all: a wrong hint
        elif hint.demote.target_tier not in lower:
            problems.add(Reason.UNSUPPORTED)  # a tier this engine does not have
    return problems


def _may_also_reject(hint: pb.Hint) -> bool:
    """Durations outside google.protobuf.Duration's range are malformed; a
    validator may reject them or treat them as very long TTLs."""
    for which in ("retain", "pin"):
        if hint.WhichOneof("action") == which and getattr(hint, which).HasField("ttl"):
            return abs(getattr(hint, which).ttl.seconds) > DURATION_MAX_S
    if hint.WhichOneof("action") == "prefetch" and hint.prefetch.HasField("deadline"):
        return abs(hint.prefetch.deadline.seconds) > DURATION_MAX_S
    return False


def _without_id(hint: pb.Hint) -> pb.Hint:
    copy = pb.Hint()
    copy.CopyFrom(hint)
    copy.hint_id = ""
    return copy


# --------------------------------------------------------------------------- properties


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.lists(hints(), max_size=CONFIG.max_hints_per_batch + 2), info=st.sampled_from([LOCAL, FULL]))
def test_every_hint_gets_a_spec_or_a_reasoned_rejection(batch, info):
    request = pb.ApplyHintsRequest(hints=batch)
    if not batch or len(batch) > CONFIG.max_hints_per_batch:
        with pytest.raises(RpcError) as exc:
            parse_apply_request(request, CONFIG, info)
        assert exc.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert exc.value.field == "hints"
        assert exc.value.reason is (Reason.TOO_MANY_HINTS if batch else Reason.MALFORMED_REQUEST)
        return
    parsed = parse_apply_request(request, CONFIG, info)  # never raises for per-hint problems
    assert [p.wire for p in parsed] == list(batch) and all((p.spec is None) != (p.rejection is None) for p in parsed)
    items = [p.item for p in parsed]
    assert len(items) == len(batch)
    for hint, item in zip(batch, items):
        problems = oracle(hint, info)
        assert item.hint_id == hint.hint_id
        if isinstance(item, HintResult):
            assert item.outcome is Outcome.REJECTED
            assert item.reason is not Reason.UNSPECIFIED and item.message
            assert item.reason in problems or (not problems and _may_also_reject(hint) and item.reason is Reason.INVALID_HINT), (
                f"rejected with {item.reason.name}, oracle says {sorted(p.name for p in problems)}"
            )
            continue
        assert isinstance(item, HintSpec)
        assert not problems, f"accepted a hint with problems {sorted(p.name for p in problems)}: {hint}"
        _check_spec(hint, item)


def _check_spec(hint: pb.Hint, spec: HintSpec) -> None:
    which = hint.WhichOneof("action")
    assert spec.action is ACTION_OF[which]
    assert spec.max_blocks == hint.max_blocks
    sel, target = hint.selector, hint.selector.WhichOneof("target")
    assert spec.selector.kind is KIND_OF[target]
    if target == "session":
        assert spec.selector.session_id == sel.session.session_id
        assert spec.selector.include_children == sel.session.include_children
    elif target == "continuation":
        assert spec.selector.continuation_id == sel.continuation.continuation_id
    else:
        assert spec.selector.block_hashes == tuple(dict.fromkeys(sel.block_hashes.block_hashes))  # duplicates ignored
    if sel.HasField("range"):
        assert spec.selector.range_start == sel.range.start
        assert spec.selector.range_end == (sel.range.end if sel.range.HasField("end") else None)
    if which in ("retain", "pin"):
        requested = _secs(getattr(hint, which).ttl)
        assert spec.requested_ttl_s == requested  # preserved, even above the cap
        assert spec.ttl_s == min(requested, CONFIG.max_ttl_s)  # granted at the cap
        assert spec.priority == (hint.retain.priority if which == "retain" else 0)
    else:
        assert spec.ttl_s is None and spec.requested_ttl_s is None
    if which == "prefetch":
        if hint.prefetch.HasField("deadline"):
            assert spec.deadline_s == min(_secs(hint.prefetch.deadline), CONFIG.max_ttl_s)
        else:
            assert spec.deadline_s is None
    if which == "share":
        assert spec.destination == hint.share.destination
    if which == "demote":
        assert spec.target_tier == (Tier(hint.demote.target_tier) if hint.demote.target_tier else None)


@settings(max_examples=150, deadline=None)
@given(a=hints(), b=hints(), new_id=good_id)
def test_fingerprint_identifies_the_hint_without_its_id(a, b, new_id):
    """Idempotency compares fingerprints: the same hint under another id must
    match, a different hint must not."""
    info = FULL
    [sa] = items_of(pb.ApplyHintsRequest(hints=[a]), CONFIG, info)
    renamed = pb.Hint()
    renamed.CopyFrom(a)
    renamed.hint_id = new_id[: CONFIG.max_hint_id_length]
    [sr] = items_of(pb.ApplyHintsRequest(hints=[renamed]), CONFIG, info)
    [sb] = items_of(pb.ApplyHintsRequest(hints=[b]), CONFIG, info)
    if isinstance(sa, HintSpec) and isinstance(sr, HintSpec):
        assert sa.fingerprint == sr.fingerprint
    if isinstance(sa, HintSpec) and isinstance(sb, HintSpec):
        assert (sa.fingerprint == sb.fingerprint) == (_without_id(a) == _without_id(b))


def test_ttl_above_cap_is_granted_at_the_cap_with_the_request_preserved():
    hint = pb.Hint(
        hint_id="x",
        selector=pb.Selector(session=pb.SessionSelector(session_id="s")),
        pin=pb.PinAction(ttl=duration_pb2.Duration(seconds=7200, nanos=500_000_000)),
    )
    [spec] = items_of(pb.ApplyHintsRequest(hints=[hint]), CONFIG, LOCAL)
    assert isinstance(spec, HintSpec)
    assert spec.ttl_s == CONFIG.max_ttl_s and spec.requested_ttl_s == 7200.5


@pytest.mark.parametrize("action", ["demote", "prefetch", "share"])
def test_unadvertised_actions_are_rejected_unsupported(action):
    hint = pb.Hint(hint_id="x", selector=pb.Selector(session=pb.SessionSelector(session_id="s")))
    getattr(hint, action).SetInParent()
    if action == "share":
        hint.share.destination = "peer-1:50151"
    [result] = items_of(pb.ApplyHintsRequest(hints=[hint]), CONFIG, LOCAL)
    assert isinstance(result, HintResult)
    assert (result.outcome, result.reason) == (Outcome.REJECTED, Reason.UNSUPPORTED)


@pytest.mark.parametrize(
    ("target_tier", "reason"),
    [(pb.TIER_DEVICE, Reason.INVALID_HINT), (99, Reason.INVALID_HINT), (pb.TIER_REMOTE, Reason.UNSUPPORTED)],
)
def test_a_demote_target_that_is_no_lower_tier_is_invalid_and_a_missing_one_unsupported(target_tier, reason):
    """TIER_DEVICE or an undefined value can never be a Demote's target (a wrong hint); a lower
    tier this engine lacks is a capability it does not have. Either names the field."""
    from kvhint_unit_support import tiered_engine_info  # device, host and disk; no remote tier

    hint = pb.Hint(hint_id="x", selector=pb.Selector(session=pb.SessionSelector(session_id="s")),
                   demote=pb.DemoteAction(target_tier=target_tier))
    [result] = items_of(pb.ApplyHintsRequest(hints=[hint]), CONFIG, tiered_engine_info())
    assert isinstance(result, HintResult)
    assert (result.outcome, result.reason) == (Outcome.REJECTED, reason)
    assert "target_tier" in result.message or "lower tier" in result.message


def test_one_bad_hint_does_not_fail_the_batch():
    good = pb.Hint(selector=pb.Selector(session=pb.SessionSelector(session_id="s")), release=pb.ReleaseAction())
    bad = pb.Hint(hint_id="bad", release=pb.ReleaseAction())  # no selector
    items = items_of(pb.ApplyHintsRequest(hints=[good, bad, good]), CONFIG, LOCAL)
    assert [type(i) for i in items] == [HintSpec, HintResult, HintSpec]
    assert items[1].reason is Reason.INVALID_HINT


# --------------------------------------------------------------------------- over the wire

UNARY = ["ApplyHints", "QueryResidency", "ListSessions", "GetOperation", "GetCapabilities"]
REQUEST_OF = {
    "ApplyHints": pb.ApplyHintsRequest,
    "QueryResidency": pb.QueryResidencyRequest,
    "ListSessions": pb.ListSessionsRequest,
    "GetOperation": pb.GetOperationRequest,
    "GetCapabilities": pb.GetCapabilitiesRequest,
}


def test_random_bytes_are_invalid_argument_and_the_server_keeps_serving(make_harness):
    harness = make_harness(max_hints_per_batch=8)
    seen_invalid = 0

    @settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(method=st.sampled_from(UNARY), raw=st.one_of(
        st.binary(max_size=64),
        # Likely undecodable: a length-delimited field 1 whose length overruns the message.
        st.binary(max_size=30).map(lambda b: b"\x0a\x7f" + b),
        # Invalid UTF-8 inside a string field (ApplyHints: hints[0].hint_id).
        st.just(b"\x0a\x04\x0a\x02\xc3\x28"),
    ))
    def run(method, raw):
        nonlocal seen_invalid
        try:
            REQUEST_OF[method].FromString(raw)
            decodable = True
        except Exception:  # noqa: BLE001 - DecodeError and friends
            decodable = False
        try:
            harness.raw(method)(raw, timeout=5)
        except grpc.RpcError as err:
            code = err.code()
            assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), (method, raw, code, err.details())
            info = error_info(err)
            assert info is not None, "failed RPC without google.rpc.ErrorInfo"
            assert info.domain == "kvhint.v1"
            if code is grpc.StatusCode.NOT_FOUND:
                assert info.reason == "REASON_NOT_FOUND"
            else:
                assert info.reason in ("REASON_MALFORMED_REQUEST", "REASON_TOO_MANY_HINTS"), info.reason
            seen_invalid += code is grpc.StatusCode.INVALID_ARGUMENT
        else:
            assert decodable, f"{method} accepted undecodable bytes {raw!r}"
        # The server keeps answering.
        caps = harness.stub.GetCapabilities(pb.GetCapabilitiesRequest(), timeout=5)
        assert caps.protocol_version == "kvhint.v1"

    run()
    assert seen_invalid > 0


def test_undecodable_request_names_the_message_in_error_info(harness):
    with pytest.raises(grpc.RpcError) as exc:
        harness.raw("ApplyHints")(b"\x0a\x7f\x01", timeout=5)
    assert exc.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    info = error_info(exc.value)
    assert info is not None and info.domain == "kvhint.v1" and info.reason == "REASON_MALFORMED_REQUEST"
