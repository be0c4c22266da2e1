"""Hint policies for the benchmark.

`LibraryPolicy` is the policy a router deploys, `kvhint_client.policy.SessionPolicy`,
driven by a trace's runtime signals: the shared prefix is declared as a template, every
``tool_call_started`` (with its tool name when the trace has one, and the declared duration
class), ``child_spawned`` and ``session_ended`` becomes the matching lifecycle signal, and the
runtime's own requests become ``RequestSent`` (the policy learns pause durations from those
gaps, causally). The kvhint.v1 hints it sends are translated one to one into the abstract
actions below, which the simulators (`bench.simulate`) and the engine driver apply.

The earlier reference policy (runs b and c) and the action types live in
`bench.reference_policy` and are re-exported here.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from kvhint.v1 import kvhint_pb2 as pb
from kvhint_client import continuation
from kvhint_client.durations import duration_to_seconds
from kvhint_client.policy import PolicyConfig as LibraryConfig
from kvhint_client.policy import SessionPolicy, TemplateDeclared
from kvhint_client.policy import signals as lib

from bench.reference_policy import (
    Action,
    Demote,
    Pin,
    PolicyConfig,
    Prefetch,
    ReferencePolicy,
    Release,
    Retain,
    Target,
    TimedAction,
    action_to_json,
    policy_variant,
    run_policy,
    shared_prefix_target,
)
from bench.trace import ChildSpawned, SessionEnded, Signal, ToolCallStarted, TraceHeader

TEMPLATE_ID = "shared-prefix"


def library_config(header: TraceHeader, **overrides: Any) -> LibraryConfig:
    """The library policy's configuration for a trace: its declared duration classes as priors.
    Nothing else is taken from the trace."""
    return replace(LibraryConfig(declared_classes=dict(header.duration_classes or {})), **overrides)


class _Accepting:
    """A sink for the simulators: every hint is applied as sent."""

    def apply(self, hints: Sequence[pb.Hint]) -> list[pb.HintResult]:
        return [pb.HintResult(hint_id=h.hint_id, outcome=pb.OUTCOME_ACCEPTED) for h in hints]


class ClairvoyantSessionPolicy(SessionPolicy):
    """A diagnostic, not a policy anyone can run: `SessionPolicy` whose prediction for a paused
    session is its true next request time (`starts`: session -> sorted request start times).
    It separates what the engine's expected-reuse order can capture from what the predictions
    miss."""

    def __init__(self, config: LibraryConfig, starts: Mapping[str, Sequence[float]], **kw: Any) -> None:
        super().__init__(config, **kw)
        self._starts = starts

    def forecast(self, s: Any, now: float) -> tuple[float, float]:
        times = self._starts.get(s.sid, ())
        j = bisect.bisect_right(times, now)
        r = times[j] - now if j < len(times) else 10 * self.max_ttl_s  # never again
        return r, r


class LibraryPolicy:
    """`SessionPolicy` on a trace's signals; each call returns the abstract actions sent then.
    With `true_starts` the predictions are the true resume times (`ClairvoyantSessionPolicy`).
    `pause_state`: start the pause model from a `PauseModel.export()` (warm start).

    `engine_results`: the caller sends the hints to an engine and feeds back what it answered
    (`take_sent`, then `record` or `requeue`), as a router does (the engine replay). Otherwise
    every hint counts as applied when it is sent (the simulators apply every action)."""

    def __init__(
        self,
        config: LibraryConfig,
        shared_prefix: Target | None = None,
        true_starts: Mapping[str, Sequence[float]] | None = None,
        pause_state: Mapping[str, Any] | None = None,
        engine_results: bool = False,
    ) -> None:
        self._now = 0.0
        if true_starts is None:
            self.policy = SessionPolicy(config, clock=lambda: self._now, pause_state=pause_state, id_prefix="b")
        else:
            self.policy = ClairvoyantSessionPolicy(
                config, true_starts, clock=lambda: self._now, pause_state=pause_state, id_prefix="b"
            )
        self.shared_prefix = shared_prefix
        self._sink = _Accepting()
        self.engine_results = engine_results
        self._sent: list[pb.Hint] = []  # engine_results: the last call's hints, in its actions' order

    def start(self, t: float = 0.0) -> list[Action]:
        if self.shared_prefix is not None:
            self.policy.observe(TemplateDeclared(TEMPLATE_ID, continuation(self.shared_prefix.id), t=t))
        return self._flush(t)

    def request(self, session_id: str, t: float) -> list[Action]:
        """The runtime sends a request of `session_id` at `t`."""
        self.policy.observe(lib.RequestSent(session_id, t=max(t, self._now)))
        return self._flush(t)

    def completed(self, session_id: str, t: float) -> None:
        """A request of `session_id` completed at `t` (observed, not flushed: a tool call or
        spawn signalled at the same moment replaces the idle pause before any hint goes out,
        as a router that sees one response sends one signal): until its next signal or request the
        session is idle (`RequestCompleted`), which is how a session whose user left, with no
        `session_ended`, stops being protected once the policy has learned that idle pauses
        rarely come back."""
        self.policy.observe(lib.RequestCompleted(session_id, t=max(t, self._now)))

    def observe(self, sig: Signal) -> list[Action]:
        t = max(sig.t, self._now)
        if isinstance(sig, ToolCallStarted):
            tools = (sig.tool,) if sig.tool else ()
            self.policy.observe(lib.ToolCallStarted(sig.session_id, tools=tools, expected_class=sig.expected_duration_class, t=t))
        elif isinstance(sig, ChildSpawned):
            self.policy.observe(lib.ChildSpawned(sig.parent_session_id, sig.child_session_id, t=t))
        elif isinstance(sig, SessionEnded):
            self.policy.observe(lib.SessionEnded(sig.session_id, t=t))
        else:  # pragma: no cover - typed union
            raise TypeError(f"not a signal: {sig!r}")
        return self._flush(t)

    def tick(self, t: float) -> list[Action]:
        """Time passes to `t` (the simulators call it before each request)."""
        return self._flush(t)

    def _flush(self, t: float) -> list[Action]:
        self._now = max(self._now, t)
        if self.engine_results:
            self._sent = self.policy.due(self._now)
            return [self.to_action(hint) for hint in self._sent]
        return [self.to_action(hint) for hint, _ in self.policy.flush(self._sink, self._now)]

    def take_sent(self) -> list[pb.Hint]:
        """With `engine_results`: the hints behind the actions the last call returned (one per
        action, same order), for `record` or `requeue` once they were sent."""
        sent, self._sent = self._sent, []
        return sent

    def record(self, hints: Sequence[pb.Hint], results: Sequence[pb.HintResult]) -> None:
        """What the engine answered for `hints` (from `take_sent`)."""
        self.policy.record(hints, results)

    def requeue(self, hints: Sequence[pb.Hint]) -> None:
        """`hints` (from `take_sent`) were not sent: the policy sends them again later."""
        self.policy.requeue(hints)

    def to_action(self, hint: pb.Hint) -> Action:
        """A kvhint.v1 hint as the abstract action the simulators apply."""
        sel = hint.selector
        if sel.HasField("continuation"):
            if self.shared_prefix is None or sel.continuation.continuation_id != self.shared_prefix.id:
                raise ValueError(f"unknown continuation {sel.continuation.continuation_id!r}")
            target = self.shared_prefix
        else:
            target = Target.session(sel.session.session_id)
        kind = hint.WhichOneof("action")
        if kind == "retain":
            reuse = _seconds(hint.retain, "expected_reuse_in")
            return Retain(target, hint.retain.priority, duration_to_seconds(hint.retain.ttl), reuse)
        if kind == "pin":
            return Pin(target, duration_to_seconds(hint.pin.ttl), _seconds(hint.pin, "expected_reuse_in"))
        if kind == "release":
            return Release(target)
        if kind == "demote":
            return Demote(target)
        if kind == "prefetch":
            return Prefetch(target)
        raise ValueError(f"unexpected action {kind!r}")


def _seconds(msg: Any, name: str) -> float | None:
    return duration_to_seconds(getattr(msg, name)) if msg.HasField(name) else None


__all__ = [
    "Action",
    "ClairvoyantSessionPolicy",
    "Demote",
    "LibraryPolicy",
    "Pin",
    "PolicyConfig",
    "Prefetch",
    "ReferencePolicy",
    "Release",
    "Retain",
    "Target",
    "TimedAction",
    "action_to_json",
    "library_config",
    "policy_variant",
    "run_policy",
    "shared_prefix_target",
]
