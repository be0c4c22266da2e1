"""Lifecycle signals a router or an agent runtime feeds a `SessionPolicy`.

Each signal is an immutable record of something that just happened. `t` is
the caller's clock in seconds (any monotonic origin, the same for every
signal of one policy); None means "now" by the policy's clock. Signals must
arrive in time order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from ..builders import Target


@dataclass(frozen=True)
class RequestSent:
    """The session sent a request (a pause, if any, ends here).

    `session_class` (optional, sticky): a label of the session's kind (e.g. an
    agent type); pause durations are also learned per class."""

    session_id: str
    session_class: Optional[str] = None
    t: Optional[float] = None


@dataclass(frozen=True)
class RequestCompleted:
    """The session's request finished. Until the next signal the session is
    idle (a pause of unknown cause, learned under the key ``("idle",)``)."""

    session_id: str
    t: Optional[float] = None


@dataclass(frozen=True)
class ToolCallStarted:
    """The session is paused on tool call(s).

    `tools`: the tool name(s) called (pause durations are learned per sorted
    tuple of names). `expected_duration_s`: the caller's own estimate, used as
    the prior's median for this call. `expected_class`: a declared duration
    class (e.g. "short"/"long"), used as a fallback key and, with
    `PolicyConfig.declared_classes`, as a prior."""

    session_id: str
    tools: tuple[str, ...] = ()
    expected_duration_s: Optional[float] = None
    expected_class: Optional[str] = None
    t: Optional[float] = None


@dataclass(frozen=True)
class ToolCallFinished:
    """The tool call(s) returned; the session is about to send its next request."""

    session_id: str
    t: Optional[float] = None


@dataclass(frozen=True)
class ChildSpawned:
    """`parent_session_id` started a child session (a sub-agent or a branch) and waits for it."""

    parent_session_id: str
    child_session_id: str
    t: Optional[float] = None


@dataclass(frozen=True)
class ChildJoined:
    """The parent collected the child's result; the child is done."""

    parent_session_id: str
    child_session_id: str
    t: Optional[float] = None


@dataclass(frozen=True)
class SessionEnded:
    """The session (or a dead branch) will send no more requests: its blocks are released."""

    session_id: str
    t: Optional[float] = None


@dataclass(frozen=True)
class TemplateDeclared:
    """Content future sessions will share (a system prompt, tool schemas): kept at the
    template priority, refreshed before its TTL runs out, until `TemplateRetired`.

    `target`: its selector, e.g. ``continuation("sys-v3")`` or ``blocks(*hashes)``."""

    template_id: str
    target: Target
    t: Optional[float] = None


@dataclass(frozen=True)
class TemplateRetired:
    """The template is no longer used: its retention is released."""

    template_id: str
    t: Optional[float] = None


Signal = Union[
    RequestSent,
    RequestCompleted,
    ToolCallStarted,
    ToolCallFinished,
    ChildSpawned,
    ChildJoined,
    SessionEnded,
    TemplateDeclared,
    TemplateRetired,
]

__all__ = [
    "ChildJoined",
    "ChildSpawned",
    "RequestCompleted",
    "RequestSent",
    "SessionEnded",
    "Signal",
    "TemplateDeclared",
    "TemplateRetired",
    "ToolCallFinished",
    "ToolCallStarted",
]
