"""Conformance profiles: the capabilities a target MUST advertise to claim a profile.

A profile turns "not advertised" from a reason to skip into a failure. The runner's
`--profile NAME` (default `core`) selects one; then

* `capabilities/profile-<name>` fails unless the target advertises every capability the
  profile (and every profile it includes) requires, and
* a case that requires a capability the selected profile requires FAILS when the target does
  not advertise it, instead of being skipped. Capabilities outside the profile still skip.

So a servicer that advertises no actions cannot pass the suite by having every hint case
skipped. Capability names are the vocabulary of `conformance.target` (`<action>:<selector>`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Profile:
    name: str
    summary: str
    # Capabilities this profile adds to the profiles it includes.
    adds: tuple[str, ...]
    includes: tuple[str, ...] = ()


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            "core", "Retain, Pin, Release and Evict on session selectors",
            ("retain:session", "pin:session", "release:session", "evict:session"),
        ),
        Profile(
            "tiers", "core plus Demote, Prefetch and Share on session selectors",
            ("demote:session", "prefetch:session", "share:session"), includes=("core",),
        ),
    )
}
DEFAULT = "core"


def included(name: str) -> list[str]:
    """`name` and every profile it includes, transitively (includes first)."""
    out: list[str] = []
    for parent in PROFILES[name].includes:
        out += [p for p in included(parent) if p not in out]
    return out + [name]


def required(name: str) -> frozenset[str]:
    """Every capability the profile `name` requires, including its included profiles'."""
    return frozenset(c for p in included(name) for c in PROFILES[p].adds)
