"""The engine-neutral enums mirror kvhint.v1's enums exactly, by name and value.

`kvhint_server.model` converts wire values with `Enum(pb_value)`, so a value
added to the proto and not to the mirror (or renumbered in one of them) would
turn into a ValueError on the engine thread or a wrong outcome on the wire.
This test is the one place that ties the two together.
"""

from __future__ import annotations

import enum

import pytest

from kvhint.v1 import kvhint_pb2 as pb
from kvhint_server.events import EventKind
from kvhint_server.model import Action, Outcome, Reason, RemovalCause, RetentionClass, SelectorKind, Tier
from kvhint_server.operations import OperationState

# (python mirror, proto enum descriptor, prefix of the proto value names)
MIRRORS = [
    (Tier, pb.Tier.DESCRIPTOR, "TIER_"),
    (Action, pb.Action.DESCRIPTOR, "ACTION_"),
    (SelectorKind, pb.SelectorKind.DESCRIPTOR, "SELECTOR_KIND_"),
    (Outcome, pb.Outcome.DESCRIPTOR, "OUTCOME_"),
    (Reason, pb.Reason.DESCRIPTOR, "REASON_"),
    (RemovalCause, pb.RemovalCause.DESCRIPTOR, "REMOVAL_CAUSE_"),
    (EventKind, pb.EventKind.DESCRIPTOR, "EVENT_KIND_"),
    (RetentionClass, pb.RetentionState.Class.DESCRIPTOR, "CLASS_"),
    (OperationState, pb.Operation.State.DESCRIPTOR, "STATE_"),
]


def _wire(descriptor: object, prefix: str) -> dict[str, int]:
    out = {}
    for value in descriptor.values:  # type: ignore[attr-defined]
        assert value.name.startswith(prefix), f"{descriptor.full_name}.{value.name} does not start with {prefix}"  # type: ignore[attr-defined]
        out[value.name.removeprefix(prefix)] = value.number
    return out


@pytest.mark.parametrize("mirror,descriptor,prefix", MIRRORS, ids=[m[0].__name__ for m in MIRRORS])
def test_mirror_equals_the_wire_enum(mirror: type[enum.IntEnum], descriptor: object, prefix: str) -> None:
    wire = _wire(descriptor, prefix)
    # UNSPECIFIED (0) is a wire-only "not set" value unless the mirror carries it too.
    if "UNSPECIFIED" not in mirror.__members__:
        assert wire.pop("UNSPECIFIED") == 0
    assert {m.name: m.value for m in mirror} == wire
