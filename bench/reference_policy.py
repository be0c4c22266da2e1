"""The earlier reference hint policy (runs b and c), kept as the baseline the
library policy (`bench.policy.LibraryPolicy`, `kvhint_client.policy`) is
compared with; and the abstract hint actions both translate to.

The policy sees only what an agent runtime knows at that moment, one signal at
a time (`ReferencePolicy.observe`): "a tool call started, expected to be
short/long" (the guess can be wrong), "a session ended", "a child session was
spawned". It never sees requests, true tool durations or anything later in the
trace. Its output is a list of abstract hint actions that translate one-to-one
to kvhint.v1 hints:

=====================================  =========================================
abstract action                        kvhint.v1 hint
=====================================  =========================================
``Pin(target, ttl_s)``                 Pin{ttl}, selector session/continuation
``Retain(target, priority, ttl_s)``    Retain{priority, ttl}
``Release(target)``                    Release
``Demote(target)``                     Demote (nearest lower tier)
``Prefetch(target, delay_s)``          Prefetch, sent ``delay_s`` after the signal
=====================================  =========================================

``Target.kind`` is ``"session"`` (``id`` = session_id) or ``"prefix"`` (the
shared system/tool prefix: ``id`` = its continuation id, ``num_tokens`` = its
length; an engine adapter resolves it to the first ``num_tokens //
block_size`` block hashes of `bench.trace.Trace.shared_prefix_tokens`, or to a
continuation selector if the engine has seen that continuation).

Rules and why. Retain priorities follow the expected time until the data is
read again: shared prefix (every request) > parent waiting for its children
(they read its context now) > short pause > long pause > ordinary data >
released data. All TTLs derive from the runtime's declared duration classes
(``TraceHeader.duration_classes``), never from the trace's actual durations.

* start: ``Retain(shared prefix, prefix_priority, prefix_ttl_s)``, refreshed
  when half its TTL has elapsed (checked on each signal). Every session starts
  with that prefix, so it is the most valuable content; the highest Retain
  priority keeps it above all session data without spending pin budget.
* tool_call_started, expected ``short``: ``Pin(session, pin_ttl_factor *
  short_class_s)`` plus ``Retain(session, short_priority, retain_ttl_factor *
  long_class_s)``. A session that resumes within seconds will re-read its
  whole context; a pin is the strongest protection and its short TTL bounds
  the damage when the guess is wrong. Pins are budgeted, though: a long
  context or several paused sessions exceed the budget and the pin is clipped
  to the head of the chain. The Retain ranks the rest (and the session after
  the pin expires, e.g. a long call mislabelled short) above long-paused
  sessions -- without it an unpinned short pause would sit BELOW every
  long-paused session, inverting the expected-reuse order.
* tool_call_started, expected ``long``: ``Retain(session, long_priority,
  retain_ttl_factor * long_class_s)``. Worth keeping over anonymous/ended
  data, but the first session data to go under pressure: it will not be read
  for a long time. With tiers (``demote_on_long``): ``Demote(session)``
  instead, so the device copy goes first while a host copy keeps the session,
  plus ``Prefetch(session, delay_s=prefetch_after_factor * long_class_s)``: a
  runtime timer set from the declared class alone, so lower-tier copies are
  staged toward the device before the expected resume (a no-op ACCEPTED when
  the session is still on the device, or already in the nearest tier).
* child_spawned: ``Retain(parent, parent_priority, retain_ttl_factor *
  long_class_s)`` once per parent wait. The parent resumes only after its
  children end (a long wait), but the children re-read the parent's context as
  their prefix, so it ranks above a plain long pause.
* session_ended: ``Release(session)`` (if ``release_on_end``): its private
  blocks are first in line for eviction; blocks shared with live sessions
  (the prefix, a parent's context) keep the other sessions' protection.

A session has one pin slot and one retain slot (as in `bench.simulate`): a
later Pin replaces its earlier Pin, a later Retain its earlier Retain, and a
Release drops both.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Union

from bench.trace import ChildSpawned, SessionEnded, Signal, ToolCallStarted, TraceHeader


@dataclass(frozen=True)
class Target:
    kind: str  # "session" | "prefix"
    id: str
    num_tokens: int | None = None  # prefix targets: prefix length in tokens

    @staticmethod
    def session(session_id: str) -> Target:
        return Target("session", session_id)


@dataclass(frozen=True)
class Pin:
    target: Target
    ttl_s: float
    expected_reuse_in_s: float | None = None  # kvhint.v1 PinAction.expected_reuse_in
    name = "pin"


@dataclass(frozen=True)
class Retain:
    target: Target
    priority: int
    ttl_s: float
    expected_reuse_in_s: float | None = None  # kvhint.v1 RetainAction.expected_reuse_in
    name = "retain"


@dataclass(frozen=True)
class Release:
    target: Target
    name = "release"


@dataclass(frozen=True)
class Demote:
    target: Target
    name = "demote"


@dataclass(frozen=True)
class Prefetch:
    target: Target
    delay_s: float = 0.0  # the runtime sends it this long after the signal (a timer, not a prediction)
    name = "prefetch"


Action = Union[Pin, Retain, Release, Demote, Prefetch]


@dataclass(frozen=True)
class TimedAction:
    t: float
    action: Action


@dataclass(frozen=True)
class PolicyConfig:
    short_class_s: float = 2.0  # runtime's nominal upper bound of a "short" tool call
    long_class_s: float = 40.0  # ... of a "long" one
    pin_ttl_factor: float = 2.0
    retain_ttl_factor: float = 1.5
    long_priority: int = 10
    short_priority: int = 30
    parent_priority: int = 50
    prefix_priority: int = 100
    prefix_ttl_s: float = 600.0
    release_on_end: bool = True
    retain_shared_prefix: bool = True
    demote_on_long: bool = False  # tiers: Demote + timed Prefetch instead of the long-pause Retain
    prefetch_after_factor: float = 0.2  # Prefetch timer, x long_class_s after a long call starts

    @classmethod
    def from_header(cls, header: TraceHeader, **overrides: Any) -> PolicyConfig:
        dc = header.duration_classes or {}
        cfg = cls(
            short_class_s=float(dc.get("short", cls.short_class_s)),
            long_class_s=float(dc.get("long", cls.long_class_s)),
        )
        return replace(cfg, **overrides)


def shared_prefix_target(header: TraceHeader) -> Target | None:
    sp = header.shared_prefix
    if not sp:
        return None
    return Target("prefix", str(sp["continuation_id"]), int(sp["tokens"]))


class ReferencePolicy:
    """Stateful but causal: `observe` sees signals in time order, one at a time."""

    def __init__(self, config: PolicyConfig, shared_prefix: Target | None = None):
        self.config = config
        self.shared_prefix = shared_prefix
        self._prefix_refreshed_at: float | None = None
        self._waiting_parents: set[str] = set()
        self._last_t = float("-inf")

    def start(self, t: float = 0.0) -> list[Action]:
        return self._maybe_refresh_prefix(t)

    def _maybe_refresh_prefix(self, t: float) -> list[Action]:
        c = self.config
        if not (c.retain_shared_prefix and self.shared_prefix is not None):
            return []
        if self._prefix_refreshed_at is not None and t < self._prefix_refreshed_at + c.prefix_ttl_s / 2:
            return []
        self._prefix_refreshed_at = t
        return [Retain(self.shared_prefix, c.prefix_priority, c.prefix_ttl_s)]

    def observe(self, sig: Signal) -> list[Action]:
        if sig.t < self._last_t:
            raise ValueError("signals must arrive in time order")
        self._last_t = sig.t
        c = self.config
        out = self._maybe_refresh_prefix(sig.t)
        if isinstance(sig, ToolCallStarted):
            self._waiting_parents.discard(sig.session_id)
            tgt = Target.session(sig.session_id)
            if sig.expected_duration_class == "short":
                out.append(Pin(tgt, c.pin_ttl_factor * c.short_class_s))
                out.append(Retain(tgt, c.short_priority, c.retain_ttl_factor * c.long_class_s))
            elif c.demote_on_long:
                out.append(Demote(tgt))
                out.append(Prefetch(tgt, c.prefetch_after_factor * c.long_class_s))
            else:
                out.append(Retain(tgt, c.long_priority, c.retain_ttl_factor * c.long_class_s))
        elif isinstance(sig, ChildSpawned):
            if sig.parent_session_id not in self._waiting_parents:
                self._waiting_parents.add(sig.parent_session_id)
                out.append(
                    Retain(Target.session(sig.parent_session_id), c.parent_priority, c.retain_ttl_factor * c.long_class_s)
                )
        elif isinstance(sig, SessionEnded):
            self._waiting_parents.discard(sig.session_id)
            if c.release_on_end:
                out.append(Release(Target.session(sig.session_id)))
        else:  # pragma: no cover - typed union
            raise TypeError(f"not a signal: {sig!r}")
        return out


def run_policy(
    signals: Iterable[Signal], config: PolicyConfig, shared_prefix: Target | None = None, t0: float = 0.0
) -> list[TimedAction]:
    """Fold the policy over a signal stream; each action is stamped with the
    time of the signal that produced it (``t0`` for the start actions)."""
    pol = ReferencePolicy(config, shared_prefix)
    out = [TimedAction(t0, a) for a in pol.start(t0)]
    for sig in signals:
        out.extend(TimedAction(sig.t, a) for a in pol.observe(sig))
    return out


def action_to_json(a: Action) -> dict[str, Any]:
    d: dict[str, Any] = {"action": a.name, "target": {"kind": a.target.kind, "id": a.target.id}}
    if a.target.num_tokens is not None:
        d["target"]["num_tokens"] = a.target.num_tokens
    if isinstance(a, (Pin, Retain)):
        d["ttl_s"] = a.ttl_s
        if a.expected_reuse_in_s is not None:
            d["expected_reuse_in_s"] = a.expected_reuse_in_s
    if isinstance(a, Retain):
        d["priority"] = a.priority
    if isinstance(a, Prefetch):
        d["delay_s"] = a.delay_s
    return d


def policy_variant(name: str, base: PolicyConfig) -> PolicyConfig:
    """Named variants used by the benchmark runs: ``hints`` (run b: no
    Release on session end), ``hints+release`` (run c) and ``hints+tiers``
    (run g: run c plus Demote and a timed Prefetch on a long pause)."""
    variants: Mapping[str, dict[str, Any]] = {
        "hints": {"release_on_end": False},
        "hints+release": {"release_on_end": True},
        "hints+tiers": {"release_on_end": True, "demote_on_long": True},
    }
    return replace(base, **variants[name])
