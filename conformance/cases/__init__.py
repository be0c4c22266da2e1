"""The kvhint.v1 conformance cases, registered in run order."""

from __future__ import annotations

from ..model import Registry
from . import (
    bad_input,
    capabilities,
    clipping,
    event_stream,
    events,
    expected_reuse,
    idempotency,
    outcomes,
    queries,
    release_evict,
    requirements,
    retention,
    selectors,
    unhinted,
)

MODULES = (
    requirements,
    capabilities,
    outcomes,
    clipping,
    idempotency,
    bad_input,
    selectors,
    queries,
    release_evict,
    retention,
    expected_reuse,
    events,
    event_stream,
    unhinted,
)
from . import consistency  # noqa: E402  (events and queries agree; owned by its own helper)

MODULES = (*MODULES, consistency)
from . import tenancy  # noqa: E402  (two tenants' isolation; skips without --tenant-* options)

MODULES = (*MODULES, tenancy)


def build_registry() -> Registry:
    reg = Registry()
    for module in MODULES:
        module.register(reg)
    return reg


REGISTRY = build_registry()
