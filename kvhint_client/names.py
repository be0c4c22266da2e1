"""Short, stable names for kvhint.v1 enums, used by the CLI, JSON output and the envelope mapping.

Tiers are named "device", "host", "disk", "remote" (parse also accepts the proto names such as
"TIER_HOST" and vLLM's medium names "GPU", "CPU", "STORAGE"). Outcomes, reasons, actions and
event kinds are named by their proto enum name without the prefix ("ACCEPTED", "TTL_CAPPED",
"PIN", "BLOCKS_STORED"); parse functions accept either form, case-insensitively.
"""

from __future__ import annotations

from typing import Union

from kvhint.v1 import kvhint_pb2

TierLike = Union[int, str]

TIER_NAMES: dict[int, str] = {
    kvhint_pb2.TIER_DEVICE: "device",
    kvhint_pb2.TIER_HOST: "host",
    kvhint_pb2.TIER_DISK: "disk",
    kvhint_pb2.TIER_REMOTE: "remote",
}
#: vLLM medium names (KV events) for the tiers that have one.
VLLM_MEDIUMS: dict[str, int] = {
    "GPU": kvhint_pb2.TIER_DEVICE,
    "CPU": kvhint_pb2.TIER_HOST,
    "STORAGE": kvhint_pb2.TIER_DISK,
}
_TIER_BY_NAME: dict[str, int] = {name: value for value, name in TIER_NAMES.items()}


def tier_name(tier: int) -> str:
    """"device", "host", "disk", "remote"; "unspecified" for 0; the number for unknown values."""
    if tier == kvhint_pb2.TIER_UNSPECIFIED:
        return "unspecified"
    return TIER_NAMES.get(tier, str(tier))


def parse_tier(value: TierLike) -> kvhint_pb2.Tier.ValueType:
    """A Tier from a short name, proto name, vLLM medium name or number. Raises ValueError."""
    if isinstance(value, bool):
        raise ValueError(f"unknown tier {value!r}")
    if isinstance(value, int):
        if value in TIER_NAMES:
            return kvhint_pb2.Tier.ValueType(value)
        raise ValueError(f"unknown tier {value!r}; choose one of {sorted(TIER_NAMES.values())}")
    text = str(value).strip()
    if text.upper() in VLLM_MEDIUMS:
        return kvhint_pb2.Tier.ValueType(VLLM_MEDIUMS[text.upper()])
    lowered = text.lower()
    if lowered.startswith("tier_"):
        lowered = lowered[len("tier_"):]
    if lowered in _TIER_BY_NAME:
        return kvhint_pb2.Tier.ValueType(_TIER_BY_NAME[lowered])
    raise ValueError(f"unknown tier {value!r}; choose one of {sorted(TIER_NAMES.values())}")


def enum_name(enum: object, prefix: str, value: int) -> str:
    """`value`'s name in `enum` without `prefix` ("EVICTED" for RemovalCause 1); the number for a
    value this client does not know (a newer server's: proto3 enums are open), never an error."""
    try:
        name: str = enum.Name(value)  # type: ignore[attr-defined]
    except ValueError:
        return str(value)
    return name[len(prefix):] if name.startswith(prefix) else name


def _enum_parse(enum: object, prefix: str, text: str, what: str) -> int:
    upper = text.strip().upper().replace("-", "_")
    if not upper.startswith(prefix):
        upper = prefix + upper
    try:
        value: int = enum.Value(upper)  # type: ignore[attr-defined]
    except ValueError:
        choices = [n[len(prefix):].lower() for n in enum.keys()  # type: ignore[attr-defined]
                   if not n.endswith("_UNSPECIFIED")]
        raise ValueError(f"unknown {what} {text!r}; choose one of {choices}") from None
    if value == 0:
        raise ValueError(f"{what} must not be unspecified")
    return value


def outcome_name(outcome: int) -> str:
    """"ACCEPTED", "CLIPPED", "DEFERRED", "REJECTED", "MISSING"."""
    return enum_name(kvhint_pb2.Outcome, "OUTCOME_", outcome)


def reason_name(reason: int) -> str:
    """"TTL_CAPPED", "NOT_RESIDENT", ...; "" for REASON_UNSPECIFIED."""
    if reason == kvhint_pb2.REASON_UNSPECIFIED:
        return ""
    return enum_name(kvhint_pb2.Reason, "REASON_", reason)


def action_name(action: int) -> str:
    """"RETAIN", "PIN", ... for kvhint_pb2.Action values."""
    return enum_name(kvhint_pb2.Action, "ACTION_", action)


def event_kind_name(kind: int) -> str:
    return enum_name(kvhint_pb2.EventKind, "EVENT_KIND_", kind)


def parse_event_kind(text: str) -> kvhint_pb2.EventKind.ValueType:
    """An EventKind from "blocks_stored", "BLOCKS_STORED" or "EVENT_KIND_BLOCKS_STORED"."""
    return kvhint_pb2.EventKind.ValueType(_enum_parse(kvhint_pb2.EventKind, "EVENT_KIND_", text, "event kind"))


def operation_state_name(state: int) -> str:
    return enum_name(kvhint_pb2.Operation.State, "STATE_", state)
