"""Conversion between vLLM's KvHintsEnvelope and kvhint.v1 Hints.

The envelope (vllm/v1/kv_hints/protocol.py, vLLM RFC #53421; the same shape Dynamo emits and
TensorRT-LLM / SGLang adopt) is

    {"protocol_version": "0.1", "message_id": "...",
     "actions": [{"action_id": "...", "action_type": "...", "action_version": "...",
                  "payload": {...}}]}

Action names. The only action type published so far is Dynamo/KVCR's `kv.fetch` version "1.0"
(payload {"source_control_endpoint", "block_hashes": [u64, ...], "mode", "no_retain"}): a
request-scoped *pull* from a source worker into the engine serving the request. kvhint.v1 has no
such action (Share is a push from the engine holding the KV), so `kv.fetch` is rejected like any
other unsupported type. The kvhint actions follow the same `kv.<verb>` / "1.0" convention:

    action_type    action_version   kvhint.v1 action   payload keys besides "selector"/"max_blocks"
    kv.retain      1.0              RetainAction       ttl_seconds (required), priority, expected_reuse_in_seconds
    kv.pin         1.0              PinAction          ttl_seconds (required), expected_reuse_in_seconds
    kv.release     1.0              ReleaseAction      -
    kv.evict       1.0              EvictAction        -
    kv.demote      1.0              DemoteAction       target_tier
    kv.prefetch    1.0              PrefetchAction     deadline_seconds
    kv.share       1.0              ShareAction        destination (required)

Payload schema (version 1.0), shared by all actions:

    "selector":   exactly one of
                    {"session_id": str, "include_children": bool}
                    {"continuation_id": str}
                    {"block_hashes": [hex str | int, ...]}
                  plus optional "range": {"start": int, "end": int} (half-open chain positions;
                  "end" omitted = to the end of the chain; not allowed with block_hashes)
    "max_blocks":  int >= 0
    "ttl_seconds", "deadline_seconds": JSON number of seconds (> 0); a decimal string such as
                  "4000000.000000001" is emitted only where a double would lose nanoseconds
    "expected_reuse_in_seconds": the same, >= 0 (RetainAction / PinAction.expected_reuse_in;
                  omitted: no expectation)
    "priority":    int32
    "target_tier": "device" | "host" | "disk" | "remote" (also accepted: "TIER_HOST", and vLLM's
                  medium names "GPU" / "CPU" / "STORAGE")
    "destination": str

Block hashes are lowercase hex strings. Integers are accepted too and mean the 8-byte big-endian
encoding (how kvhint.v1 carries vLLM's 64-bit int hashes, the form Dynamo's kv.fetch uses);
`hints_to_envelope(..., block_hash_format="int")` emits that form for 8-byte hashes.

Identity: action_id <-> Hint.hint_id. Hints without an id get a uuid4 action_id (envelope ids
are required by TensorRT-LLM and expected by Dynamo) unless `assign_ids=False`.

Canonical form and round trip: emitted payloads omit defaults (include_children false, priority
0, max_blocks 0, unset target_tier / deadline). `action_to_hint(hint_to_action(h)) == h` for every
valid hint with a hint_id, and `hints_to_envelope(envelope_to_hints(e), message_id=...) == e` for
every canonical envelope; non-canonical input (explicit defaults, int hashes, tier aliases)
normalises to the canonical form.

Rejections raise EnvelopeError (a ValueError) naming the action index, id and the problem: an
unsupported protocol_version, action_type or action_version (listing the supported ones),
unknown payload keys, an action_id that repeats an earlier action's, and anything the builders
reject (empty ids, ttl <= 0, bad range, ...).
With `skip_unknown=True`, actions of unsupported *types* are skipped instead (a mixed envelope
carrying e.g. kv.fetch for another consumer), but unsupported versions of kvhint types still fail.

Works on plain dicts / JSON text, and on vLLM's msgspec structs when vLLM is importable; vLLM is
never required (`to_vllm_envelope` imports it lazily).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Literal, Optional, Union

from google.protobuf import duration_pb2

from kvhint.v1 import kvhint_pb2

from .builders import Target, blocks, continuation, session
from .durations import check_duration_range, duration_from_decimal, duration_to_decimal
from .names import TIER_NAMES, parse_tier

PROTOCOL_VERSION = "0.1"
ACTION_VERSION = "1.0"
SUPPORTED_PROTOCOL_VERSIONS = (PROTOCOL_VERSION,)
SUPPORTED_ACTION_VERSIONS = (ACTION_VERSION,)

#: envelope action_type -> Hint oneof field name.
ACTION_TYPES: dict[str, str] = {
    "kv.retain": "retain",
    "kv.pin": "pin",
    "kv.release": "release",
    "kv.evict": "evict",
    "kv.demote": "demote",
    "kv.prefetch": "prefetch",
    "kv.share": "share",
}
_ACTION_TYPE_OF: dict[str, str] = {hint_field: action_type for action_type, hint_field in ACTION_TYPES.items()}
_ACTION_PARAMS: dict[str, frozenset[str]] = {
    "retain": frozenset({"ttl_seconds", "priority", "expected_reuse_in_seconds"}),
    "pin": frozenset({"ttl_seconds", "expected_reuse_in_seconds"}),
    "release": frozenset(),
    "evict": frozenset(),
    "demote": frozenset({"target_tier"}),
    "prefetch": frozenset({"deadline_seconds"}),
    "share": frozenset({"destination"}),
}
_COMMON_KEYS = frozenset({"selector", "max_blocks"})
_SELECTOR_KEYS = frozenset({"session_id", "include_children", "continuation_id", "block_hashes", "range"})
_FOREIGN_ACTION_NOTES = {
    "kv.fetch": "kv.fetch (Dynamo/KVCR) pulls blocks from a source worker into this request's engine; "
    "kvhint.v1 has no pull action (send kv.share to the engine holding the blocks instead)",
}

BlockHashFormat = Literal["hex", "int"]
EnvelopeLike = Union[Mapping[str, Any], str, bytes, Any]


class EnvelopeError(ValueError):
    """An envelope or action kvhint cannot lower (or a hint it cannot express as an action)."""


@dataclass(frozen=True)
class ParsedEnvelope:
    """An envelope lowered to hints. `skipped` holds actions left out by skip_unknown=True."""

    message_id: str
    hints: list[kvhint_pb2.Hint]
    skipped: list[dict[str, Any]] = field(default_factory=list)


# -- envelope -> hints ----------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """msgspec structs (vLLM's KvHintsEnvelope / KvHintAction) to dicts, recursively."""
    fields = getattr(type(value), "__struct_fields__", None)
    if fields is not None:
        return {name: _plain(getattr(value, name)) for name in fields}
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _as_dict(envelope: EnvelopeLike) -> dict[str, Any]:
    if isinstance(envelope, (str, bytes, bytearray)):
        try:
            envelope = json.loads(envelope)
        except json.JSONDecodeError as error:
            raise EnvelopeError(f"envelope is not valid JSON: {error}") from None
    plain = _plain(envelope)
    if not isinstance(plain, dict):
        raise EnvelopeError(f"envelope must be an object, got {type(plain).__name__}")
    return plain


def _require(mapping: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    if key not in mapping:
        raise EnvelopeError(f"{where}: missing {key!r}")
    value = mapping[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise EnvelopeError(f"{where}: {key!r} must be {kind.__name__}, got {type(value).__name__}")
    return value


def _seconds(value: Any, key: str, *, zero: bool = False) -> duration_pb2.Duration:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{key} must be a number of seconds, got {value!r}")
    try:
        seconds = Decimal(value) if isinstance(value, (int, str)) else Decimal(repr(float(value)))
    except ArithmeticError:
        raise ValueError(f"{key} must be a number of seconds, got {value!r}") from None
    if not seconds.is_finite() or seconds < 0 or (seconds == 0 and not zero):
        raise ValueError(f"{key} must be {'>=' if zero else '>'} 0 seconds, got {value!r}")
    check_duration_range(seconds, key, value)  # (a string such as "1e999999" overflowed the conversion)
    return duration_from_decimal(seconds)


def _int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    return value


def _target(selector: Any) -> Target:
    if not isinstance(selector, Mapping):
        raise ValueError(f"selector must be an object, got {type(selector).__name__}")
    unknown = set(selector) - _SELECTOR_KEYS
    if unknown:
        raise ValueError(f"unknown selector key(s) {sorted(unknown)}; allowed: {sorted(_SELECTOR_KEYS)}")
    present = [k for k in ("session_id", "continuation_id", "block_hashes") if k in selector]
    if len(present) != 1:
        raise ValueError("selector needs exactly one of session_id, continuation_id, block_hashes")
    include_children = selector.get("include_children", False)
    if not isinstance(include_children, bool):
        raise ValueError("include_children must be a boolean")
    if include_children and present[0] != "session_id":
        raise ValueError("include_children applies to session_id selectors only")
    if present[0] == "session_id":
        target = session(selector["session_id"], include_children=include_children)
    elif present[0] == "continuation_id":
        target = continuation(selector["continuation_id"])
    else:
        hashes = selector["block_hashes"]
        if not isinstance(hashes, list) or not hashes:
            raise ValueError("block_hashes must be a non-empty list")
        target = blocks(hashes)  # (one list: a single item that is not a hash is not taken for a list)
    if "range" in selector:
        rng = selector["range"]
        if not isinstance(rng, Mapping) or set(rng) - {"start", "end"}:
            raise ValueError('range must be {"start": int, "end": int}')
        end = rng.get("end")
        target = target.range(_int(rng.get("start", 0), "range.start"), None if end is None else _int(end, "range.end"))
    return target


def _build_hint(hint_field: str, action_id: str, payload: Mapping[str, Any]) -> kvhint_pb2.Hint:
    unknown = set(payload) - _COMMON_KEYS - _ACTION_PARAMS[hint_field]
    if unknown:
        allowed = sorted(_COMMON_KEYS | _ACTION_PARAMS[hint_field])
        raise ValueError(f"unknown payload key(s) {sorted(unknown)}; allowed: {allowed}")
    if "selector" not in payload:
        raise ValueError("payload needs a selector")
    target = _target(payload["selector"])
    common: dict[str, Any] = {
        "hint_id": action_id or None,
        "max_blocks": _int(payload.get("max_blocks", 0), "max_blocks"),
    }
    if hint_field in ("retain", "pin"):
        if "ttl_seconds" not in payload:
            raise ValueError(f"kv.{hint_field} needs ttl_seconds")
        ttl = _seconds(payload["ttl_seconds"], "ttl_seconds")
        reuse = payload.get("expected_reuse_in_seconds")
        if reuse is not None:
            common["expected_reuse_in"] = _seconds(reuse, "expected_reuse_in_seconds", zero=True)
        if hint_field == "retain":
            return target.retain(ttl, _int(payload.get("priority", 0), "priority"), **common)
        return target.pin(ttl, **common)
    if hint_field == "release":
        return target.release(**common)
    if hint_field == "evict":
        return target.evict(**common)
    if hint_field == "demote":
        tier = payload.get("target_tier")
        return target.demote(None if tier is None else parse_tier(tier), **common)
    if hint_field == "prefetch":
        deadline = payload.get("deadline_seconds")
        return target.prefetch(None if deadline is None else _seconds(deadline, "deadline_seconds"), **common)
    if "destination" not in payload:
        raise ValueError("kv.share needs destination")
    destination = payload["destination"]
    if not isinstance(destination, str):
        raise ValueError("destination must be a string")
    return target.share(destination, **common)


def action_to_hint(action: Any, *, index: int = 0) -> kvhint_pb2.Hint:
    """One envelope action (dict or msgspec KvHintAction) as a Hint. Raises EnvelopeError."""
    action = _plain(action)
    where = f"action {index}"
    if not isinstance(action, dict):
        raise EnvelopeError(f"{where}: must be an object, got {type(action).__name__}")
    action_id = _require(action, "action_id", str, where)
    where = f"action {index} (id {action_id!r})"
    action_type = _require(action, "action_type", str, where)
    version = _require(action, "action_version", str, where)
    payload = _require(action, "payload", dict, where)
    if action_type not in ACTION_TYPES:
        note = _FOREIGN_ACTION_NOTES.get(action_type)
        raise EnvelopeError(
            f"{where}: unsupported action_type {action_type!r}; supported: {', '.join(sorted(ACTION_TYPES))}"
            + (f" ({note})" if note else "")
        )
    if version not in SUPPORTED_ACTION_VERSIONS:
        raise EnvelopeError(
            f"{where}: unsupported action_version {version!r} for {action_type}; "
            f"supported: {', '.join(SUPPORTED_ACTION_VERSIONS)}"
        )
    try:
        return _build_hint(ACTION_TYPES[action_type], action_id, payload)
    except EnvelopeError:
        raise
    except ValueError as error:
        raise EnvelopeError(f"{where}, {action_type}: {error}") from None


def parse_envelope(envelope: EnvelopeLike, *, skip_unknown: bool = False) -> ParsedEnvelope:
    """Lower an envelope (dict, JSON text/bytes, or vLLM KvHintsEnvelope) to hints, in order."""
    data = _as_dict(envelope)
    version = _require(data, "protocol_version", str, "envelope")
    if version not in SUPPORTED_PROTOCOL_VERSIONS:
        raise EnvelopeError(
            f"envelope: unsupported protocol_version {version!r}; supported: {', '.join(SUPPORTED_PROTOCOL_VERSIONS)}"
        )
    message_id = _require(data, "message_id", str, "envelope")
    actions = _require(data, "actions", list, "envelope")
    hints: list[kvhint_pb2.Hint] = []
    skipped: list[dict[str, Any]] = []
    first_with_id: dict[str, int] = {}
    for index, action in enumerate(actions):
        if skip_unknown and isinstance(action, dict) and action.get("action_type") not in ACTION_TYPES:
            skipped.append(action)
            continue
        hint = action_to_hint(action, index=index)
        if hint.hint_id:
            earlier = first_with_id.setdefault(hint.hint_id, index)
            if earlier != index:
                # One id, two actions: the engine would bind the id to the first and reject the
                # second (HINT_ID_CONFLICT), and a router could not tell their results apart.
                raise EnvelopeError(f"action {index} (id {hint.hint_id!r}): repeats the action_id of action {earlier}")
        hints.append(hint)
    return ParsedEnvelope(message_id=message_id, hints=hints, skipped=skipped)


def envelope_to_hints(envelope: EnvelopeLike, *, skip_unknown: bool = False) -> list[kvhint_pb2.Hint]:
    """The hints of an envelope, in action order (see parse_envelope)."""
    return parse_envelope(envelope, skip_unknown=skip_unknown).hints


# -- hints -> envelope ----------------------------------------------------------------------------


def _seconds_json(duration: duration_pb2.Duration) -> Union[int, float, str]:
    exact = duration_to_decimal(duration)
    if exact == exact.to_integral_value():
        return int(exact)
    as_float = float(exact)
    if Decimal(repr(as_float)) == exact:
        return as_float
    return format(exact.normalize(), "f")


def _hash_json(raw: bytes, block_hash_format: BlockHashFormat) -> Union[str, int]:
    if block_hash_format == "int":
        if len(raw) != 8:
            raise EnvelopeError(f"block hash {raw.hex()} is {len(raw)} bytes; block_hash_format='int' needs 8-byte hashes")
        return int.from_bytes(raw, "big")
    return raw.hex()


def _selector_json(target: Target, block_hash_format: BlockHashFormat) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if target.session_id is not None:
        out["session_id"] = target.session_id
        if target.include_children:
            out["include_children"] = True
    elif target.continuation_id is not None:
        out["continuation_id"] = target.continuation_id
    else:
        out["block_hashes"] = [_hash_json(h, block_hash_format) for h in target.block_hashes]
    if target.range_start is not None:
        out["range"] = {"start": target.range_start}
        if target.range_end is not None:
            out["range"]["end"] = target.range_end
    return out


def hint_to_action(
    hint: kvhint_pb2.Hint,
    *,
    action_id: Optional[str] = None,
    block_hash_format: BlockHashFormat = "hex",
) -> dict[str, Any]:
    """One Hint as an envelope action dict. action_id defaults to hint.hint_id (may be "")."""
    kind = hint.WhichOneof("action")
    if kind is None:
        raise EnvelopeError("hint has no action")
    try:
        target = Target.from_selector(hint.selector)
    except ValueError as error:
        raise EnvelopeError(f"hint {hint.hint_id!r}: {error}") from None
    payload: dict[str, Any] = {"selector": _selector_json(target, block_hash_format)}
    if kind in ("retain", "pin"):
        action = hint.retain if kind == "retain" else hint.pin
        if not action.HasField("ttl") or duration_to_decimal(action.ttl) <= 0:
            raise EnvelopeError(f"hint {hint.hint_id!r}: {kind} needs a ttl > 0")
        payload["ttl_seconds"] = _seconds_json(action.ttl)
        if kind == "retain" and hint.retain.priority:
            payload["priority"] = hint.retain.priority
        if action.HasField("expected_reuse_in"):
            if duration_to_decimal(action.expected_reuse_in) < 0:
                raise EnvelopeError(f"hint {hint.hint_id!r}: expected_reuse_in must be >= 0")
            payload["expected_reuse_in_seconds"] = _seconds_json(action.expected_reuse_in)
    elif kind == "demote" and hint.demote.target_tier:
        payload["target_tier"] = TIER_NAMES.get(hint.demote.target_tier) or _raise_tier(hint.demote.target_tier)
    elif kind == "prefetch" and hint.prefetch.HasField("deadline"):
        if duration_to_decimal(hint.prefetch.deadline) <= 0:
            raise EnvelopeError(f"hint {hint.hint_id!r}: prefetch deadline must be > 0")
        payload["deadline_seconds"] = _seconds_json(hint.prefetch.deadline)
    elif kind == "share":
        if not hint.share.destination:
            raise EnvelopeError(f"hint {hint.hint_id!r}: share needs a destination")
        payload["destination"] = hint.share.destination
    if hint.max_blocks:
        payload["max_blocks"] = hint.max_blocks
    return {
        "action_id": hint.hint_id if action_id is None else action_id,
        "action_type": _ACTION_TYPE_OF[kind],
        "action_version": ACTION_VERSION,
        "payload": payload,
    }


def _raise_tier(tier: int) -> str:
    raise EnvelopeError(f"unknown target_tier {tier}")


def hints_to_envelope(
    hints: Iterable[kvhint_pb2.Hint],
    *,
    message_id: Optional[str] = None,
    assign_ids: bool = True,
    block_hash_format: BlockHashFormat = "hex",
) -> dict[str, Any]:
    """A KvHintsEnvelope dict (JSON-ready) for `hints`. message_id defaults to a uuid4; hints
    without hint_id get a uuid4 action_id unless assign_ids=False."""
    actions = []
    first_with_id: dict[str, int] = {}
    for index, hint in enumerate(hints):
        if hint.hint_id and first_with_id.setdefault(hint.hint_id, index) != index:
            raise EnvelopeError(f"hints[{index}].hint_id {hint.hint_id!r} repeats hints[{first_with_id[hint.hint_id]}]'s: "
                                "an envelope's action ids are unique")
        action_id = hint.hint_id or (str(uuid.uuid4()) if assign_ids else "")
        actions.append(hint_to_action(hint, action_id=action_id, block_hash_format=block_hash_format))
    return {
        "protocol_version": PROTOCOL_VERSION,
        "message_id": str(uuid.uuid4()) if message_id is None else message_id,
        "actions": actions,
    }


def to_vllm_envelope(
    hints: Iterable[kvhint_pb2.Hint],
    *,
    message_id: Optional[str] = None,
    assign_ids: bool = True,
    block_hash_format: BlockHashFormat = "hex",
) -> Any:
    """vLLM's `KvHintsEnvelope` msgspec struct for `hints` (needs vLLM installed)."""
    try:
        from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope
    except ImportError as error:
        raise ImportError(
            "to_vllm_envelope() needs vLLM (vllm.v1.kv_hints); hints_to_envelope() returns the same envelope as a dict"
        ) from error
    data = hints_to_envelope(hints, message_id=message_id, assign_ids=assign_ids, block_hash_format=block_hash_format)
    return KvHintsEnvelope(
        protocol_version=data["protocol_version"],
        message_id=data["message_id"],
        actions=[KvHintAction(**action) for action in data["actions"]],
    )
