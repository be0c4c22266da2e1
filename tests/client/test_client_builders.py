"""Builders: selectors and hints read naturally and reject malformed input client-side."""

from __future__ import annotations

import datetime as dt

import pytest

from kvhint.v1 import kvhint_pb2
from kvhint_client.builders import Target, blocks, continuation, event_filter, session


def test_session_pin_builds_the_expected_hint() -> None:
    hint = session("S").pin(ttl=30)
    assert hint.WhichOneof("action") == "pin"
    assert hint.selector.session.session_id == "S"
    assert not hint.selector.session.include_children
    assert hint.pin.ttl.seconds == 30 and hint.pin.ttl.nanos == 0
    assert hint.hint_id == "" and hint.max_blocks == 0


def test_retain_with_children_priority_ttl_and_ids() -> None:
    hint = session("S", include_children=True).retain(priority=5, ttl=60, hint_id="h-1", max_blocks=8)
    assert hint.selector.session.include_children
    assert (hint.retain.priority, hint.retain.ttl.seconds) == (5, 60)
    assert (hint.hint_id, hint.max_blocks) == ("h-1", 8)


def test_every_action_and_selector_kind() -> None:
    assert continuation("c1").evict().selector.continuation.continuation_id == "c1"
    rel = blocks(b"\x01" * 32, "ab" * 16).release()
    assert list(rel.selector.block_hashes.block_hashes) == [b"\x01" * 32, bytes.fromhex("ab" * 16)]
    assert rel.WhichOneof("action") == "release"
    dem = session("S").range(0, 4).demote(target_tier="host")
    assert (dem.selector.range.start, dem.selector.range.end) == (0, 4)
    assert dem.demote.target_tier == kvhint_pb2.TIER_HOST
    assert session("S").demote().demote.target_tier == kvhint_pb2.TIER_UNSPECIFIED
    assert session("S").share("10.0.0.2:50151").share.destination == "10.0.0.2:50151"
    pre = session("S").prefetch()
    assert pre.WhichOneof("action") == "prefetch" and not pre.prefetch.HasField("deadline")
    assert session("S").prefetch(deadline=2.5).prefetch.deadline.nanos == 500_000_000


def test_open_ended_range_has_no_end() -> None:
    sel = session("S").range(3).selector
    assert sel.range.start == 3 and not sel.range.HasField("end")


def test_ttl_accepts_float_and_timedelta_exactly() -> None:
    assert session("S").pin(ttl=0.1).pin.ttl.nanos == 100_000_000
    ttl = session("S").pin(ttl=dt.timedelta(minutes=2, milliseconds=5)).pin.ttl
    assert (ttl.seconds, ttl.nanos) == (120, 5_000_000)


class ReprFloat(float):
    """A float subclass whose repr is not a number, as numpy.float64's is under NumPy 2."""

    def __repr__(self) -> str:
        return f"np.float64({float(self)!r})"


def float_subclasses(value: float) -> list[float]:
    values: list[float] = [ReprFloat(value)]
    try:
        import numpy
    except ImportError:
        return values
    return [*values, numpy.float64(value)]


@pytest.mark.parametrize("value", float_subclasses(0.1), ids=lambda v: type(v).__name__)
def test_float_subclass_seconds_convert_like_floats(value: float) -> None:
    """A TTL a router computed with numpy (numpy.float64 is a float) used to raise
    "ttl np.float64(0.1) is out of range"."""
    assert session("S").pin(ttl=value) == session("S").pin(ttl=0.1)
    assert session("S").retain(ttl=1, expected_reuse_in=value).retain.expected_reuse_in.nanos == 100_000_000
    assert session("S").prefetch(deadline=value).prefetch.deadline.nanos == 100_000_000


def test_a_duration_past_protobufs_range_is_refused_before_sending() -> None:
    """google.protobuf.Duration holds +-315,576,000,000 s; past it the server REJECTs the hint as a
    malformed Duration (INVALID_HINT, not a TTL capped at max_ttl). The builders used to build it."""
    message = r"must be at most 315576000000 seconds \(google.protobuf.Duration's range"
    with pytest.raises(ValueError, match="ttl " + message):
        session("S").pin(ttl=4e11)
    with pytest.raises(ValueError, match="ttl " + message):
        session("S").retain(ttl=315_576_000_001)
    with pytest.raises(ValueError, match="expected_reuse_in " + message):
        session("S").pin(ttl=1, expected_reuse_in=10**12)
    with pytest.raises(ValueError, match="deadline " + message):
        session("S").prefetch(deadline=dt.timedelta(days=4_000_000))
    assert session("S").pin(ttl=315_576_000_000).pin.ttl.seconds == 315_576_000_000


def test_int_block_hash_is_8_byte_big_endian() -> None:
    assert blocks(1).selector.block_hashes.block_hashes[0] == b"\x00" * 7 + b"\x01"
    assert blocks(-1).selector.block_hashes.block_hashes[0] == b"\xff" * 8
    assert blocks("0xABCD").selector.block_hashes.block_hashes[0] == b"\xab\xcd"


def test_duplicate_hashes_are_dropped_in_order() -> None:
    assert blocks(b"b", b"a", b"b").block_hashes == (b"b", b"a")


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: session(""), "session_id must not be empty"),
        (lambda: continuation(""), "continuation_id must not be empty"),
        (lambda: session("S").pin(ttl=0), "ttl must be > 0"),
        (lambda: session("S").pin(ttl=-1.5), "ttl must be > 0"),
        (lambda: session("S").retain(ttl=True), "ttl must be a number"),
        (lambda: session("S").retain(ttl=1, priority=2**31), "priority must be a 32-bit integer"),
        (lambda: session("S").pin(ttl=1, hint_id=""), "hint_id must not be empty"),
        (lambda: session("S").evict(max_blocks=-1), "max_blocks must be an integer"),
        (lambda: session("S").range(4, 4), "must be greater than start"),
        (lambda: session("S").range(-1), "range start"),
        (lambda: blocks(), "at least one block hash"),
        (lambda: blocks("zz"), "not hexadecimal"),
        (lambda: blocks(None), "block hash must be bytes, hex or int, got NoneType"),  # (was TypeError)
        (lambda: blocks(1.5), "block hash must be bytes, hex or int, got float"),
        (lambda: blocks(b""), "1..64 bytes"),
        (lambda: blocks(b"x" * 65), "1..64 bytes"),
        (lambda: blocks(2**64), "does not fit in 64 bits"),
        (lambda: blocks(b"a").range(0, 2), "cannot narrow a block-hash selector"),
        (lambda: session("S").demote(target_tier="ssd"), "unknown tier"),
        (lambda: session("S").share(""), "destination must not be empty"),
        (lambda: session("S").prefetch(deadline=0), "deadline must be > 0"),
        (lambda: event_filter(kinds=["nope"]), "unknown event kind"),
    ],
)
def test_bad_input_raises_clear_value_error(build, message) -> None:
    with pytest.raises(ValueError, match=message):
        build()


def test_target_round_trips_through_selector() -> None:
    target = session("S", include_children=True).range(2, 9)
    assert Target.from_selector(target.selector) == target
    with pytest.raises(ValueError, match="no target"):
        Target.from_selector(kvhint_pb2.Selector())


def test_event_filter_accepts_names() -> None:
    filt = event_filter(sessions=["S"], tiers=["device", "CPU"], kinds=["blocks_stored", "EVENT_KIND_PIN_BROKEN"])
    assert list(filt.tiers) == [kvhint_pb2.TIER_DEVICE, kvhint_pb2.TIER_HOST]
    assert list(filt.kinds) == [kvhint_pb2.EVENT_KIND_BLOCKS_STORED, kvhint_pb2.EVENT_KIND_PIN_BROKEN]
