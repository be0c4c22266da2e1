"""The reproductions of crafted input (issue 14, item 3), each pinned down:
page tokens are authenticated and type-checked, ids are length-checked,
error messages quote at most a short excerpt, and hint ids follow one
conflict rule whether the hint was valid or not."""

from __future__ import annotations

import base64
import hashlib
import json

import grpc
import pytest
from google.protobuf import duration_pb2
from hypothesis import given
from hypothesis import strategies as st
from kvhint_unit_support import Harness, error_info, h, pin, session_sel

from kvhint.v1 import kvhint_pb2 as pb
from kvhint_server.config import ServerConfig
from kvhint_server.errors import EXCERPT_CHARS, RpcError, excerpt
from kvhint_server.model import Tier
from kvhint_server.page_tokens import MAX_TOKEN_CHARS, PageTokens
from kvhint_server.validation import MAX_FILTER_SESSIONS, parse_query_tiers, validate_watch_request


def _invalid(call, field: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as exc:
        call()
    err = exc.value
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
    info = error_info(err)
    assert info is not None and info.metadata["field"] == field, info
    return err


def _b64json(payload: object) -> str:
    return base64.urlsafe_b64encode(json.dumps(payload).encode()).decode()


# --------------------------------------------------------------------------- page tokens


@given(scope=st.text(max_size=20), offset=st.integers(0, 2**40), after=st.text(min_size=1, max_size=30))
def test_issued_tokens_verify_to_their_cursor(scope, offset, after):
    tokens = PageTokens("epoch-1")
    assert tokens.verify(tokens.issue(scope, "o", offset), scope, "o", int, 0) == offset
    # A cursor of exactly the limit's UTF-8 bytes (a session id at max_id_length) verifies.
    assert tokens.verify(tokens.issue(scope, "a", after), scope, "a", str, len(after.encode())) == after


@pytest.mark.parametrize(("cursor", "max_id_length"), [("\x01" * 256, 256), ("a" + "é" * 511, 1024)],
                         ids=["256-control-chars", "1023-bytes-of-2-byte-chars"])
def test_a_token_issued_for_any_valid_session_id_verifies(cursor: str, max_id_length: int) -> None:
    """ListSessions' next_page_token carries the page's last session id, which may be any
    1..max_id_length bytes of UTF-8 (256 by default, configurable): the server must accept
    back every token it issued."""
    tokens = PageTokens("0123456789abcdef")
    token = tokens.issue("0123456789abcdef", "a", cursor)
    assert len(token) > 2048  # (MAX_TOKEN_CHARS alone refused these)
    assert tokens.verify(token, "0123456789abcdef", "a", str, max_id_length) == cursor
    # Still bounded: a longer token than any cursor of that many bytes makes is refused undecoded.
    with pytest.raises(RpcError, match="longer than"):
        tokens.verify(token + "A" * (tokens.max_token_chars("0123456789abcdef", "a", max_id_length) - len(token) + 1),
                      "0123456789abcdef", "a", str, max_id_length)


@pytest.mark.parametrize("value", [-1, "x", True, None, 1.5, [1], {"o": 1}])
def test_signed_token_with_a_wrong_typed_or_negative_offset_is_refused(value):
    """Even a token carrying our own MAC is type-checked (defence in depth)."""
    tokens = PageTokens("epoch-1")
    with pytest.raises(RpcError) as exc:
        tokens.verify(tokens.issue("q", "o", value), "q", "o", int, 0)  # type: ignore[arg-type]
    assert exc.value.code is grpc.StatusCode.INVALID_ARGUMENT and exc.value.field == "page_token"


def test_tokens_of_another_key_another_scope_or_altered_are_refused():
    mine, other = PageTokens("e"), PageTokens("e")
    token = mine.issue("q", "o", 4)
    body, mac = token.split(".")
    altered = _b64json({"e": "e", "s": "q", "o": 0}).rstrip("=") + "." + mac
    for bad, why in [
        (other.issue("q", "o", 4), "altered"),
        (altered, "altered"),
        (token + "x", "issued"),
        (body, "issued"),
        ("A" * (MAX_TOKEN_CHARS + 1), "longer"),
    ]:
        with pytest.raises(RpcError) as exc:
            mine.verify(bad, "q", "o", int, 0)
        assert why in exc.value.message
    with pytest.raises(RpcError, match="different query"):
        mine.verify(token, "other", "o", int, 0)


def _scope_of_session(session_id: str) -> str:
    selector = session_sel(session_id)
    return hashlib.sha256(selector.SerializeToString(deterministic=True)).hexdigest()[:16]


@pytest.fixture
def sessions(make_harness) -> Harness:
    harness = make_harness(default_page_size=2)
    for i in range(5):
        harness.engine.store([h(10 * i + 1), h(10 * i + 2), h(10 * i + 3)], session=f"s{i}")
    return harness


def test_the_reported_crafted_tokens_are_invalid_argument_and_the_engine_thread_never_sees_them(sessions):
    epoch = sessions.core.bus.epoch
    query = lambda token: sessions.stub.QueryResidency(  # noqa: E731
        pb.QueryResidencyRequest(selector=session_sel("s0"), page_size=1, page_token=token), timeout=5
    )
    listing = lambda token: sessions.stub.ListSessions(pb.ListSessionsRequest(page_token=token), timeout=5)  # noqa: E731
    _invalid(lambda: query(_b64json({"e": epoch, "s": _scope_of_session("s0"), "o": "x"})), "page_token")
    _invalid(lambda: query(_b64json({"e": epoch, "s": _scope_of_session("s0"), "o": -1})), "page_token")
    _invalid(lambda: listing(_b64json({"e": epoch, "s": hashlib.sha256(b"").hexdigest()[:16], "a": 5})), "page_token")
    # The engine thread ran nothing that failed, and the server still pages.
    assert len(_all_sessions(sessions)) == 5


def _all_sessions(harness: Harness) -> list[str]:
    names, token = [], ""
    while True:
        page = harness.stub.ListSessions(pb.ListSessionsRequest(page_token=token), timeout=5)
        names += [s.session_id for s in page.sessions]
        token = page.next_page_token
        if not token:
            return names


def test_genuine_tokens_page_through_everything_once(sessions):
    assert _all_sessions(sessions) == [f"s{i}" for i in range(5)]
    blocks, token = [], ""
    while True:
        page = sessions.stub.QueryResidency(
            pb.QueryResidencyRequest(selector=session_sel("s1"), page_size=1, page_token=token), timeout=5
        )
        blocks += [b.block_hash for b in page.blocks]
        token = page.next_page_token
        if not token:
            break
    assert blocks == [h(11), h(12), h(13)]


def test_a_token_from_before_a_restart_is_refused(make_harness):
    first, second = make_harness(default_page_size=1), make_harness(default_page_size=1)
    for harness in (first, second):
        harness.engine.store([h(1)], session="a")
        harness.engine.store([h(2)], session="b")
    token = first.stub.ListSessions(pb.ListSessionsRequest(), timeout=5).next_page_token
    err = _invalid(lambda: second.stub.ListSessions(pb.ListSessionsRequest(page_token=token), timeout=5), "page_token")
    assert "epoch" in err.details()


# --------------------------------------------------------------------------- ids and messages


def test_excerpt_quotes_a_short_prefix_and_the_size():
    assert excerpt("abc") == "'abc'"
    long = excerpt("z" * 5000)
    assert long.startswith(repr("z" * EXCERPT_CHARS)) and "5000 chars" in long and len(long) < 2 * EXCERPT_CHARS + 20


@pytest.mark.parametrize(
    ("selector", "field"),
    [
        (pb.Selector(), "selector"),
        (pb.Selector(session=pb.SessionSelector(session_id="")), "selector.session.session_id"),
        (pb.Selector(continuation=pb.ContinuationSelector(continuation_id="")), "selector.continuation.continuation_id"),
        (pb.Selector(session=pb.SessionSelector(session_id="s"), range=pb.BlockRange(start=3, end=2)), "selector.range.end"),
        (pb.Selector(block_hashes=pb.BlockHashSelector(block_hashes=[b"x"]), range=pb.BlockRange(start=1)), "selector.range"),
        (pb.Selector(block_hashes=pb.BlockHashSelector()), "selector.block_hashes.block_hashes"),
        (pb.Selector(block_hashes=pb.BlockHashSelector(block_hashes=[b"x", b""])), "selector.block_hashes.block_hashes[1]"),
    ],
)
def test_a_bad_query_selector_names_the_field_at_fault(harness, selector: pb.Selector, field: str) -> None:
    """QueryResidency's INVALID_ARGUMENT names the selector's field, as its PERMISSION_DENIED does."""
    _invalid(lambda: harness.stub.QueryResidency(pb.QueryResidencyRequest(selector=selector), timeout=5), field)


def test_get_operation_with_a_5000_byte_id_is_invalid_argument_with_a_short_message(harness):
    err = _invalid(lambda: harness.stub.GetOperation(pb.GetOperationRequest(operation_id="x" * 5000), timeout=5), "operation_id")
    assert len(err.details()) < 100
    with pytest.raises(grpc.RpcError) as missing:
        harness.stub.GetOperation(pb.GetOperationRequest(operation_id="y" * 200), timeout=5)
    assert missing.value.code() is grpc.StatusCode.NOT_FOUND
    assert len(missing.value.details()) < 2 * EXCERPT_CHARS + 40


_WATCH = pb.WatchEventsRequest


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (_WATCH(heartbeat_interval=duration_pb2.Duration(seconds=1, nanos=-1)), "heartbeat_interval"),
        (_WATCH(heartbeat_interval=duration_pb2.Duration(nanos=1_000_000_000)), "heartbeat_interval"),
        (_WATCH(heartbeat_interval=duration_pb2.Duration(seconds=315_576_000_001)), "heartbeat_interval"),
        (_WATCH(filter=pb.EventFilter(session_ids=["s"] * (MAX_FILTER_SESSIONS + 1))), "filter.session_ids"),
        (_WATCH(filter=pb.EventFilter(session_ids=["ok", ""])), "filter.session_ids[1]"),
        (_WATCH(filter=pb.EventFilter(tiers=[pb.TIER_HOST, 5])), "filter.tiers[1]"),
        (_WATCH(start=_WATCH.START_RESUME), "resume_epoch"),
        (_WATCH(start=9), "start"),
    ],
    ids=["heartbeat-mixed-signs", "heartbeat-nanos-range", "heartbeat-seconds-range", "4097-session-ids",
         "empty-session-id", "unknown-tier", "resume-without-epoch", "unknown-start"],
)
def test_a_malformed_watch_request_names_the_field(request_: pb.WatchEventsRequest, field: str) -> None:
    with pytest.raises(RpcError) as exc:
        validate_watch_request(request_, ServerConfig())
    assert (exc.value.code, exc.value.field) == (grpc.StatusCode.INVALID_ARGUMENT, field), exc.value.message


@pytest.mark.parametrize(
    "request_",
    [
        _WATCH(heartbeat_interval=duration_pb2.Duration(seconds=-5)),  # 0 or negative: the server default
        _WATCH(heartbeat_interval=duration_pb2.Duration(seconds=0, nanos=-1)),
        _WATCH(heartbeat_interval=duration_pb2.Duration(seconds=10**6)),  # clamped, not refused
        _WATCH(filter=pb.EventFilter(session_ids=["s"] * MAX_FILTER_SESSIONS, tiers=[pb.TIER_DEVICE, pb.TIER_REMOTE])),
        _WATCH(start=_WATCH.START_RESUME, resume_epoch="e" * ServerConfig().max_id_length),
    ],
    ids=["negative-heartbeat", "negative-nanos-heartbeat", "long-heartbeat", "4096-session-ids", "epoch-at-limit"],
)
def test_a_watch_request_at_its_bounds_is_accepted(request_: pb.WatchEventsRequest) -> None:
    validate_watch_request(request_, ServerConfig())


def test_query_tiers_name_the_unknown_entry():
    assert parse_query_tiers([pb.TIER_DISK, pb.TIER_DEVICE]) == [Tier.DISK, Tier.DEVICE]
    with pytest.raises(RpcError) as exc:
        parse_query_tiers([pb.TIER_HOST, 7])
    assert (exc.value.code, exc.value.field) == (grpc.StatusCode.INVALID_ARGUMENT, "tiers[1]")


def test_every_request_id_is_length_checked(harness):
    long = "s" * (harness.config.max_id_length + 1)
    _invalid(lambda: harness.stub.ListSessions(pb.ListSessionsRequest(session_id_prefix=long), timeout=5), "session_id_prefix")
    _invalid(lambda: harness.stub.QueryResidency(pb.QueryResidencyRequest(selector=session_sel(long)), timeout=5),
             "selector.session.session_id")

    def watch(**kw: object) -> None:
        next(iter(harness.stub.WatchEvents(pb.WatchEventsRequest(**kw), timeout=5)))

    _invalid(lambda: watch(filter=pb.EventFilter(session_ids=["ok", long])), "filter.session_ids[1]")
    _invalid(lambda: watch(start=pb.WatchEventsRequest.START_RESUME, resume_epoch=long), "resume_epoch")
    _invalid(lambda: watch(filter=pb.EventFilter(tiers=[99])), "filter.tiers[0]")
    _invalid(lambda: watch(filter=pb.EventFilter(kinds=[99])), "filter.kinds[0]")
    hint = pb.Hint(selector=session_sel("s"), pin=pb.PinAction())
    hint.pin.ttl.seconds, hint.pin.ttl.nanos = 1, -5
    result = harness.apply(hint).results[0]
    assert result.outcome == pb.OUTCOME_REJECTED and result.reason == pb.REASON_INVALID_HINT


# --------------------------------------------------------------------------- hint-id conflict rule


def _invalid_hint(hint_id: str) -> pb.Hint:
    return pb.Hint(hint_id=hint_id, selector=session_sel("s0"), pin=pb.PinAction())  # Pin without a ttl


def test_a_hint_id_binds_to_content_whether_the_hint_was_valid_or_not(sessions):
    # Valid first, then invalid content under the same id: a conflict, not INVALID_HINT.
    first = sessions.apply(pin("s0", 5, hint_id="v")).results[0]
    assert first.outcome == pb.OUTCOME_ACCEPTED
    conflict = sessions.apply(_invalid_hint("v")).results[0]
    assert (conflict.outcome, conflict.reason) == (pb.OUTCOME_REJECTED, pb.REASON_HINT_ID_CONFLICT)
    # Invalid first: re-sending it replays the rejection; valid content under it conflicts.
    rejected = sessions.apply(_invalid_hint("i")).results[0]
    assert (rejected.outcome, rejected.reason, rejected.replayed) == (pb.OUTCOME_REJECTED, pb.REASON_INVALID_HINT, False)
    again = sessions.apply(_invalid_hint("i")).results[0]
    assert (again.outcome, again.reason, again.replayed) == (pb.OUTCOME_REJECTED, pb.REASON_INVALID_HINT, True)
    conflict = sessions.apply(pin("s1", 5, hint_id="i")).results[0]
    assert conflict.reason == pb.REASON_HINT_ID_CONFLICT
    # An id of exactly max_hint_id_length bytes (in multi-byte characters) is bound like any other ...
    edge = "é" * (sessions.config.max_hint_id_length // 2)
    first = sessions.apply(pin("s1", 5, hint_id=edge)).results[0]
    again = sessions.apply(pin("s1", 5, hint_id=edge)).results[0]
    assert (first.replayed, again.replayed, again.outcome) == (False, True, first.outcome)
    # ... while an over-long one is rejected and never bound (each attempt is judged alone).
    long = "L" * (sessions.config.max_hint_id_length + 1)
    for _ in range(2):
        result = sessions.apply(pin("s1", 5, hint_id=long)).results[0]
        assert (result.reason, result.replayed) == (pb.REASON_INVALID_HINT, False)


# --------------------------------------------------------------------------- validation before the rate limit


def test_a_malformed_query_is_invalid_argument_under_a_spent_rate_limit_and_costs_no_token(make_harness):
    """A QueryResidency, ListSessions or WatchEvents request that is malformed can never succeed: it is
    INVALID_ARGUMENT whatever the caller's bucket holds (never RESOURCE_EXHAUSTED with a RetryInfo
    promising that a retry can succeed), and it is refused as a whole, so it spends no rate-limit
    token, as a malformed ApplyHints batch spends none."""
    harness = make_harness(rate_limit_hints_per_s=0.01, rate_limit_burst=1)
    md = (("authorization", "Bearer q"),)
    bad_token = pb.ListSessionsRequest(page_token="not-a-token")

    def watch(**kw: object) -> None:
        next(iter(harness.stub.WatchEvents(pb.WatchEventsRequest(**kw), metadata=md, timeout=5)))

    malformed = [
        (lambda: harness.stub.QueryResidency(pb.QueryResidencyRequest(), metadata=md, timeout=5), "selector"),
        (lambda: harness.stub.QueryResidency(pb.QueryResidencyRequest(selector=session_sel("s"), tiers=[9]),
                                             metadata=md, timeout=5), "tiers[0]"),
        (lambda: harness.stub.ListSessions(bad_token, metadata=md, timeout=5), "page_token"),
        (lambda: harness.stub.ListSessions(pb.ListSessionsRequest(session_id_prefix="p" * 300), metadata=md, timeout=5),
         "session_id_prefix"),
        (lambda: watch(filter=pb.EventFilter(kinds=[99])), "filter.kinds[0]"),
    ]
    for call, field in malformed:  # the bucket's one token is still there after each
        _invalid(call, field)
    harness.stub.ListSessions(pb.ListSessionsRequest(), metadata=md, timeout=5)  # spends it
    for call, field in malformed:  # and with the bucket empty, still INVALID_ARGUMENT
        _invalid(call, field)
