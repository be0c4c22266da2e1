"""JSON view of kvhint.v1 messages, used by the CLI's --json output.

The protobuf JSON mapping with three deliberate differences, chosen for shell use (jq):
- field names are the .proto names (snake_case), not lowerCamelCase;
- bytes (block hashes) are lowercase hex, not base64;
- 64-bit integers (sequence numbers, counts) are JSON numbers, not strings.
Everything else follows the mapping: enums by full name ("OUTCOME_ACCEPTED", "TIER_DEVICE"),
Duration as "1.5s", Timestamp as RFC 3339, fields at their default value omitted, an empty
message that is set (e.g. `"release": {}`) kept.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor
from google.protobuf.message import Message

_FD = descriptor.FieldDescriptor
_WELL_KNOWN_STRINGS = ("google.protobuf.Duration", "google.protobuf.Timestamp")


def message_to_dict(message: Message) -> dict[str, Any]:
    """`message` as a JSON-ready dict (see module doc)."""
    out: dict[str, Any] = {}
    for field, value in message.ListFields():
        if field.is_repeated:
            if field.message_type is not None and field.message_type.GetOptions().map_entry:
                value_field = field.message_type.fields_by_name["value"]
                out[field.name] = {str(k): _scalar_or_message(value_field, v) for k, v in value.items()}
            else:
                out[field.name] = [_scalar_or_message(field, v) for v in value]
        else:
            out[field.name] = _scalar_or_message(field, value)
    return out


def _scalar_or_message(field: descriptor.FieldDescriptor, value: Any) -> Any:
    if field.type == _FD.TYPE_MESSAGE:
        assert field.message_type is not None
        if field.message_type.full_name in _WELL_KNOWN_STRINGS:
            return value.ToJsonString()
        return message_to_dict(value)
    if field.type == _FD.TYPE_BYTES:
        return bytes(value).hex()
    if field.type == _FD.TYPE_ENUM:
        assert field.enum_type is not None
        enum_value = field.enum_type.values_by_number.get(value)
        return enum_value.name if enum_value is not None else value
    if field.type in (_FD.TYPE_FLOAT, _FD.TYPE_DOUBLE):
        return value if value == value and value not in (float("inf"), float("-inf")) else str(value)
    return value
