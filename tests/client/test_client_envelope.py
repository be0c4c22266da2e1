"""KvHintsEnvelope <-> kvhint.v1 Hint: lossless round trips and clear rejections."""

from __future__ import annotations

import json

import pytest
from google.protobuf import duration_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhint.v1 import kvhint_pb2
from kvhint_client.builders import Target, blocks, continuation, session
from kvhint_client.envelope import (
    ACTION_TYPES,
    EnvelopeError,
    action_to_hint,
    envelope_to_hints,
    hint_to_action,
    hints_to_envelope,
    parse_envelope,
)

# -- strategies ------------------------------------------------------------------------------------

ids = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=40)
hashes = st.binary(min_size=1, max_size=64)
durations = st.one_of(
    st.integers(min_value=1, max_value=10**6),
    st.floats(min_value=1e-6, max_value=1e6, allow_nan=False, allow_infinity=False),
    st.builds(lambda s, n: duration_pb2.Duration(seconds=s, nanos=n),
              st.integers(min_value=0, max_value=10**10), st.integers(min_value=1, max_value=999_999_999)),
)


@st.composite
def targets(draw) -> Target:
    kind = draw(st.sampled_from(["session", "continuation", "blocks"]))
    if kind == "blocks":
        return blocks(*draw(st.lists(hashes, min_size=1, max_size=5)))
    target = session(draw(ids), include_children=draw(st.booleans())) if kind == "session" else continuation(draw(ids))
    if draw(st.booleans()):
        start = draw(st.integers(min_value=0, max_value=1000))
        end = draw(st.one_of(st.none(), st.integers(min_value=start + 1, max_value=2000)))
        target = target.range(start, end)
    return target


@st.composite
def hints(draw) -> kvhint_pb2.Hint:
    target = draw(targets())
    common = {"hint_id": draw(ids), "max_blocks": draw(st.integers(min_value=0, max_value=2**32 - 1))}
    action = draw(st.sampled_from(sorted(ACTION_TYPES.values())))
    reuse = draw(st.one_of(st.none(), st.just(0), durations))  # expected_reuse_in: unset, 0 or > 0
    if action == "retain":
        return target.retain(draw(durations), draw(st.integers(min_value=-(2**31), max_value=2**31 - 1)),
                             expected_reuse_in=reuse, **common)
    if action == "pin":
        return target.pin(draw(durations), expected_reuse_in=reuse, **common)
    if action == "demote":
        return target.demote(draw(st.sampled_from([None, "device", "host", "disk", "remote"])), **common)
    if action == "prefetch":
        return target.prefetch(draw(st.one_of(st.none(), durations)), **common)
    if action == "share":
        return target.share(draw(ids), **common)
    return getattr(target, action)(**common)


# -- round trips ----------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(hints())
def test_hint_to_action_to_hint_is_lossless_through_json(hint: kvhint_pb2.Hint) -> None:
    action = json.loads(json.dumps(hint_to_action(hint)))
    assert action["action_id"] == hint.hint_id
    assert action_to_hint(action) == hint


@settings(max_examples=100, deadline=None)
@given(st.lists(hints(), min_size=1, max_size=5, unique_by=lambda h: h.hint_id), ids)
def test_envelope_to_hints_to_envelope_is_lossless(batch: list[kvhint_pb2.Hint], message_id: str) -> None:
    envelope = json.loads(json.dumps(hints_to_envelope(batch, message_id=message_id)))
    parsed = parse_envelope(json.dumps(envelope))
    assert parsed.message_id == message_id and parsed.hints == batch
    assert hints_to_envelope(parsed.hints, message_id=message_id) == envelope


def test_canonical_payload_shape() -> None:
    hint = session("S", include_children=True).range(0, 4).retain(priority=5, ttl=60, hint_id="a1")
    assert hint_to_action(hint) == {
        "action_id": "a1", "action_type": "kv.retain", "action_version": "1.0",
        "payload": {"selector": {"session_id": "S", "include_children": True, "range": {"start": 0, "end": 4}},
                    "ttl_seconds": 60, "priority": 5},
    }
    evict = blocks(b"\x00\x01").evict(hint_id="a2", max_blocks=3)
    assert hint_to_action(evict)["payload"] == {"selector": {"block_hashes": ["0001"]}, "max_blocks": 3}
    demote = continuation("c").demote("host", hint_id="a3")
    assert hint_to_action(demote)["payload"] == {"selector": {"continuation_id": "c"}, "target_tier": "host"}


def test_ttl_that_a_double_cannot_hold_is_emitted_as_decimal_string() -> None:
    ttl = duration_pb2.Duration(seconds=9_000_000_000, nanos=1)
    payload = hint_to_action(session("S").pin(ttl, hint_id="p"))["payload"]
    assert payload["ttl_seconds"] == "9000000000.000000001"
    assert action_to_hint(hint_to_action(session("S").pin(ttl, hint_id="p"))).pin.ttl == ttl


def test_non_canonical_input_normalises() -> None:
    envelope = {"protocol_version": "0.1", "message_id": "m", "actions": [
        {"action_id": "x", "action_type": "kv.demote", "action_version": "1.0",
         "payload": {"selector": {"block_hashes": [1, "0x0a"], "include_children": False}, "target_tier": "CPU",
                     "max_blocks": 0}},
        {"action_id": "y", "action_type": "kv.retain", "action_version": "1.0",
         "payload": {"selector": {"session_id": "S"}, "ttl_seconds": "1.5", "priority": 0}},
    ]}
    demote, retain = envelope_to_hints(envelope)
    assert list(demote.selector.block_hashes.block_hashes) == [b"\x00" * 7 + b"\x01", b"\x0a"]
    assert demote.demote.target_tier == kvhint_pb2.TIER_HOST
    assert (retain.retain.ttl.seconds, retain.retain.ttl.nanos) == (1, 500_000_000)
    again = hints_to_envelope([demote, retain], message_id="m")
    assert again["actions"][0]["payload"] == {"selector": {"block_hashes": ["0000000000000001", "0a"]},
                                              "target_tier": "host"}
    assert again["actions"][1]["payload"] == {"selector": {"session_id": "S"}, "ttl_seconds": 1.5}


class ReprFloat(float):
    """A float subclass whose repr is not a number, as numpy.float64's is under NumPy 2."""

    def __repr__(self) -> str:
        return f"np.float64({float(self)!r})"


def test_float_subclass_seconds_in_a_payload_lower_like_floats() -> None:
    """An envelope dict a router filled with numpy.float64 seconds used to be refused
    ("ttl_seconds must be a number of seconds, got np.float64(2.5)")."""
    payload = {"selector": {"session_id": "S"}, "ttl_seconds": ReprFloat(2.5), "expected_reuse_in_seconds": ReprFloat(0.1)}
    (hint,) = envelope_to_hints(_envelope(_action(payload=payload)))
    assert hint == session("S").pin(ttl=2.5, expected_reuse_in=0.1, hint_id="a1")
    prefetch = {"selector": {"session_id": "S"}, "deadline_seconds": ReprFloat(0.5)}
    (hint,) = envelope_to_hints(_envelope(_action("kv.prefetch", payload=prefetch)))
    assert hint == session("S").prefetch(deadline=0.5, hint_id="a1")


def test_int_hash_format_matches_dynamo_style() -> None:
    envelope = hints_to_envelope([blocks(11, 22).evict(hint_id="e")], message_id="m", block_hash_format="int")
    assert envelope["actions"][0]["payload"]["selector"]["block_hashes"] == [11, 22]
    with pytest.raises(EnvelopeError, match="needs 8-byte hashes"):
        hints_to_envelope([blocks(b"abc").evict()], block_hash_format="int")


def test_ids_assigned_or_left_empty() -> None:
    hint = session("S").evict()
    assert len(hints_to_envelope([hint])["actions"][0]["action_id"]) == 36
    empty = hints_to_envelope([hint], assign_ids=False)
    assert empty["actions"][0]["action_id"] == "" and action_to_hint(empty["actions"][0]).hint_id == ""


# -- rejections -----------------------------------------------------------------------------------


def _envelope(*actions, version="0.1"):
    return {"protocol_version": version, "message_id": "m", "actions": list(actions)}


def _action(action_type="kv.pin", version="1.0", payload=None, action_id="a1"):
    return {"action_id": action_id, "action_type": action_type, "action_version": version,
            "payload": {"selector": {"session_id": "S"}, "ttl_seconds": 1} if payload is None else payload}


def test_unknown_action_type_names_it_and_the_supported_ones() -> None:
    with pytest.raises(EnvelopeError) as info:
        envelope_to_hints(_envelope(_action("kv.teleport", payload={})))
    text = str(info.value)
    assert "'kv.teleport'" in text and "action 0 (id 'a1')" in text
    for name in ACTION_TYPES:
        assert name in text


def test_dynamo_kv_fetch_is_rejected_with_an_explanation() -> None:
    fetch = _action("kv.fetch", payload={"source_control_endpoint": "tcp://h:1", "block_hashes": [1]})
    with pytest.raises(EnvelopeError, match="unsupported action_type 'kv.fetch'.*no pull action"):
        envelope_to_hints(_envelope(fetch))


def test_skip_unknown_keeps_the_supported_actions() -> None:
    fetch = _action("kv.fetch", payload={"source_control_endpoint": "tcp://h:1", "block_hashes": [1]}, action_id="f")
    parsed = parse_envelope(_envelope(fetch, _action(action_id="p")), skip_unknown=True)
    assert [h.hint_id for h in parsed.hints] == ["p"] and parsed.skipped[0]["action_id"] == "f"


def test_unknown_version_names_the_supported_one() -> None:
    with pytest.raises(EnvelopeError, match="unsupported action_version '2.0' for kv.pin; supported: 1.0"):
        envelope_to_hints(_envelope(_action(version="2.0")))
    with pytest.raises(EnvelopeError, match="unsupported action_version"):
        envelope_to_hints(_envelope(_action(version="2.0")), skip_unknown=True)
    with pytest.raises(EnvelopeError, match="unsupported protocol_version '0.2'; supported: 0.1"):
        envelope_to_hints(_envelope(_action(), version="0.2"))


@pytest.mark.parametrize(
    "payload, message",
    [
        ({"selector": {"session_id": "S"}}, "kv.pin needs ttl_seconds"),
        ({"selector": {"session_id": "S"}, "ttl_seconds": 0}, "ttl_seconds must be > 0"),
        ({"selector": {"session_id": "S"}, "ttl_seconds": "soon"}, "ttl_seconds must be a number"),
        ({"selector": {"session_id": "S"}, "ttl_seconds": 1e12}, "ttl_seconds must be at most 315576000000 seconds"),
        # a decimal string past any range: decimal.Overflow escaped as a traceback before
        ({"selector": {"session_id": "S"}, "ttl_seconds": "1e999999"}, "ttl_seconds must be at most 315576000000 seconds"),
        ({"selector": {"session_id": "S"}, "ttl_seconds": 1, "priority": 3}, r"unknown payload key\(s\) \['priority'\]"),
        ({"selector": {"session_id": ""}, "ttl_seconds": 1}, "session_id must not be empty"),
        ({"selector": {"session_id": "S", "continuation_id": "c"}, "ttl_seconds": 1}, "exactly one of"),
        ({"selector": {"block_hashes": []}, "ttl_seconds": 1}, "non-empty list"),
        # one item that is not a hash (it used to be taken for a list: TypeError, not EnvelopeError)
        ({"selector": {"block_hashes": [None]}, "ttl_seconds": 1}, "block hash must be bytes, hex or int, got NoneType"),
        ({"selector": {"block_hashes": [1.5]}, "ttl_seconds": 1}, "block hash must be bytes, hex or int, got float"),
        ({"selector": {"block_hashes": ["ab", None]}, "ttl_seconds": 1}, "block hash must be bytes, hex or int, got NoneType"),
        # one item that is a list: it was taken for the list of hashes (two blocks selected)
        ({"selector": {"block_hashes": [["ab", "cd"]]}, "ttl_seconds": 1}, "block hash must be bytes, hex or int, got list"),
        ({"selector": {"session_id": "S", "range": {"start": 5, "end": 2}}, "ttl_seconds": 1}, "greater than start"),
        ({"selector": {"session_id": "S", "colour": 1}, "ttl_seconds": 1}, "unknown selector key"),
        ({"ttl_seconds": 1}, "needs a selector"),
    ],
)
def test_bad_payloads_are_rejected_clearly(payload, message) -> None:
    with pytest.raises(EnvelopeError, match=message) as info:
        envelope_to_hints(_envelope(_action(payload=payload)))
    assert "action 0 (id 'a1')" in str(info.value)


def test_malformed_envelopes() -> None:
    with pytest.raises(EnvelopeError, match="not valid JSON"):
        envelope_to_hints("{")
    with pytest.raises(EnvelopeError, match="missing 'actions'"):
        envelope_to_hints({"protocol_version": "0.1", "message_id": "m"})
    with pytest.raises(EnvelopeError, match="'payload' must be dict"):
        envelope_to_hints(_envelope({"action_id": "a", "action_type": "kv.evict", "action_version": "1.0", "payload": []}))
    assert isinstance(EnvelopeError("x"), ValueError)


def test_a_repeated_action_id_is_refused_both_ways() -> None:
    """One id for two actions: the engine would bind it to the first and reject the second
    (HINT_ID_CONFLICT), and a router could not tell their results apart."""
    twice = [session("A").retain(ttl=5, hint_id="x"), session("B").release(hint_id="x")]
    with pytest.raises(EnvelopeError, match=r"action 1 \(id 'x'\): repeats the action_id of action 0"):
        envelope_to_hints(_envelope(*(hint_to_action(h) for h in twice)))
    with pytest.raises(EnvelopeError, match=r"hints\[1\].hint_id 'x' repeats hints\[0\]'s"):
        hints_to_envelope(twice)
    assert len(envelope_to_hints(hints_to_envelope([session("A").retain(ttl=5), session("B").release()]))) == 2  # ids assigned


def test_hints_the_envelope_cannot_express_are_refused() -> None:
    with pytest.raises(EnvelopeError, match="hint has no action"):
        hint_to_action(kvhint_pb2.Hint(selector=session("S").selector))
    bad = kvhint_pb2.Hint(selector=session("S").selector)
    bad.pin.SetInParent()
    with pytest.raises(EnvelopeError, match="pin needs a ttl > 0"):
        hint_to_action(bad)


def test_vllm_msgspec_envelope_both_ways() -> None:
    protocol = pytest.importorskip("vllm.v1.kv_hints")
    from kvhint_client.envelope import to_vllm_envelope

    batch = [session("S").pin(ttl=2.5, hint_id="p"), blocks(b"\xff").evict(hint_id="e")]
    envelope = to_vllm_envelope(batch, message_id="m1")
    assert isinstance(envelope, protocol.KvHintsEnvelope)
    assert [a.action_type for a in envelope.actions] == ["kv.pin", "kv.evict"]
    assert envelope_to_hints(envelope) == batch
    import msgspec

    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(envelope), type=protocol.KvHintsEnvelope)
    assert envelope_to_hints(wire) == batch
