"""Engine-neutral domain types shared by the core, the executor and adapters.

Enum values equal the kvhint.v1 wire values, so conversion is `Enum(pb_value)`.
Block hashes are `bytes` (the engine's external block hash, see the proto).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TypeVar


class Tier(enum.IntEnum):
    DEVICE = 1
    HOST = 2
    DISK = 3
    REMOTE = 4

    @property
    def bit(self) -> int:
        return 1 << self.value


def tiers_of(mask: int) -> list[Tier]:
    return [t for t in Tier if mask & t.bit]


E = TypeVar("E", bound=enum.IntEnum)


def parse_enum(cls: type[E], value: int, default: E | None = None) -> E | None:
    """`cls(value)` for a wire value, or `default` when the value is unknown
    to this version (a newer peer's enum value, or garbage)."""
    try:
        return cls(value)
    except ValueError:
        return default


class Action(enum.IntEnum):
    RETAIN = 1
    PIN = 2
    RELEASE = 3
    EVICT = 4
    DEMOTE = 5
    PREFETCH = 6
    SHARE = 7


class SelectorKind(enum.IntEnum):
    SESSION = 1
    CONTINUATION = 2
    BLOCK_HASHES = 3


class Outcome(enum.IntEnum):
    ACCEPTED = 1
    CLIPPED = 2
    DEFERRED = 3
    REJECTED = 4
    MISSING = 5


class Reason(enum.IntEnum):
    UNSPECIFIED = 0
    UNSUPPORTED = 1
    INVALID_HINT = 2
    TTL_CAPPED = 3
    PIN_BUDGET = 4
    BLOCKS_IN_USE = 5
    PINNED_BY_OTHER_SESSION = 6
    MAX_BLOCKS = 7
    RESOURCE_EXHAUSTED = 8
    NOT_RESIDENT = 9
    HINT_ID_CONFLICT = 10
    UNKNOWN_DESTINATION = 11
    PERMISSION_DENIED = 12
    MALFORMED_REQUEST = 13
    TOO_MANY_HINTS = 14
    DEADLINE_EXCEEDED = 15
    OPERATION_FAILED = 16
    SHUTTING_DOWN = 17
    NOT_FOUND = 18
    WINDOW_TAIL_MISSING = 19


class RetentionClass(enum.IntEnum):
    ORDINARY = 1
    RETAINED = 2
    PINNED = 3


class RemovalCause(enum.IntEnum):
    EVICTED = 1
    EVICT_HINT = 2
    DEMOTED = 3
    PIN_BROKEN = 4
    REPLACED = 5


# Retention owner keys (RetentionLedger grants are held per owner): a session's
# grants, a continuation's, and block-hash selectors' (one shared owner).
SESSION_OWNER = "s:"
CONTINUATION_OWNER = "c:"
BLOCKS_OWNER = "b:"


def session_owner(session_id: str) -> str:
    """The retention owner key of a session's grants."""
    return SESSION_OWNER + session_id


def session_of_owner(owner: str) -> str | None:
    """The session of a session owner key; None for other owners."""
    return owner[len(SESSION_OWNER):] if owner.startswith(SESSION_OWNER) else None


@dataclass(frozen=True, slots=True)
class Selector:
    """A validated selector. Exactly the fields of `kind` are meaningful."""

    kind: SelectorKind
    session_id: str = ""
    include_children: bool = False
    continuation_id: str = ""
    block_hashes: tuple[bytes, ...] = ()
    range_start: int = 0
    range_end: int | None = None
    # Block-hash selectors of a tenant (tenant_guard.py): the tenant's name, so
    # its grants are its own ("b:<name>"), not shared with every caller's.
    owner_scope: str = ""

    @property
    def owner(self) -> str:
        """Retention owner key: who a Retain/Pin is held for, and what Release drops."""
        if self.kind is SelectorKind.SESSION:
            return session_owner(self.session_id)
        if self.kind is SelectorKind.CONTINUATION:
            return CONTINUATION_OWNER + self.continuation_id
        return BLOCKS_OWNER + self.owner_scope

    @property
    def has_range(self) -> bool:
        return self.range_start > 0 or self.range_end is not None


@dataclass(frozen=True, slots=True)
class HintSpec:
    """A validated hint. `ttl_s` is the granted TTL (already capped)."""

    hint_id: str
    selector: Selector
    action: Action
    max_blocks: int = 0
    priority: int = 0
    ttl_s: float | None = None
    requested_ttl_s: float | None = None
    # The TTL asked for in integer nanoseconds, exact (Clip.requested_ttl): float seconds lose
    # the last nanosecond past 2**23 s.
    requested_ttl_ns: int | None = None
    destination: str = ""
    target_tier: Tier | None = None
    deadline_s: float | None = None
    # Retain/Pin: expected time to next use in seconds, already clamped to
    # ttl_s; None when the hint set no expectation.
    expected_reuse_s: float | None = None
    # Deterministic encoding of the hint without its id (idempotency check).
    fingerprint: bytes = b""


@dataclass(slots=True)
class Clip:
    reason: Reason
    detail: str
    requested_ttl_ns: int | None = None
    granted_ttl_s: float | None = None
    requested_blocks: int = 0
    granted_blocks: int = 0

    @classmethod
    def of_blocks(cls, reason: Reason, detail: str, requested: int, granted: int) -> Clip:
        """A clip of the selected blocks: `granted` of `requested` took effect."""
        return cls(reason, detail, requested_blocks=requested, granted_blocks=granted)


@dataclass(slots=True)
class HintResult:
    hint_id: str
    outcome: Outcome
    reason: Reason = Reason.UNSPECIFIED
    message: str = ""
    clips: list[Clip] = field(default_factory=list)
    affected: dict[Tier, int] = field(default_factory=dict)
    operation_id: str = ""
    replayed: bool = False
    effective_ttl_s: float | None = None

    @classmethod
    def rejected(cls, hint_id: str, reason: Reason, message: str) -> HintResult:
        return cls(hint_id=hint_id, outcome=Outcome.REJECTED, reason=reason, message=message)

    @classmethod
    def missing(cls, hint_id: str, message: str = "selector resolved to nothing resident") -> HintResult:
        return cls(hint_id=hint_id, outcome=Outcome.MISSING, reason=Reason.NOT_RESIDENT, message=message)


@dataclass(frozen=True, slots=True)
class RequestCoords:
    """Session coordinates carried by one engine request (all optional)."""

    session_id: str | None = None
    continuation_id: str | None = None
    parent_session_id: str | None = None

    def __bool__(self) -> bool:
        return bool(self.session_id or self.continuation_id)


@dataclass(frozen=True, slots=True)
class RetentionView:
    """Effective protection of one block."""

    cls: RetentionClass
    priority: int = 0
    expires_at: float | None = None  # wall-clock seconds
    # Monotonic time of the earliest expected reuse among the block's
    # unexpired grants that set one; None when none did.
    reuse_at: float | None = None


ORDINARY = RetentionView(RetentionClass.ORDINARY)


@dataclass(frozen=True, slots=True)
class BlockState:
    """What the engine knows about one block hash, independent of sessions."""

    block_hash: bytes
    tiers: int  # Tier bitmask
    in_use: bool = False
    parent: bytes | None = None
    position: int | None = None


@dataclass(frozen=True, slots=True)
class ActionSupport:
    action: Action
    supported: bool
    selectors: tuple[SelectorKind, ...] = ()
    supports_range: bool = False
    notes: str = ""
    supports_expected_reuse: bool = False


@dataclass(frozen=True, slots=True)
class TierInfo:
    tier: Tier
    medium: str
    capacity_blocks: int = 0
    shared: bool = False
    # A lower tier whose eviction Retain and Pin order (kvhint.v1 TierInfo.honours_retention).
    honours_retention: bool = False


class KvCacheGroupKind(enum.IntEnum):
    """What a prefix hit needs from a KV-cache group (kvhint.v1 KvCacheGroup.Kind)."""

    FULL_ATTENTION = 1  # a copy of every block of the prefix
    SLIDING_WINDOW = 2  # copies of the blocks inside the window ending at the prefix end
    OTHER = 3


@dataclass(frozen=True, slots=True)
class KvCacheGroupInfo:
    """One KV-cache group of the engine (hybrid-attention models have several)."""

    group_id: int
    kind: KvCacheGroupKind
    block_size: int
    sliding_window_tokens: int = 0
    # True when a logical block counts as resident on the device only while
    # this group holds a copy of it (see KvCacheGroup.defines_residency).
    defines_residency: bool = True


@dataclass(frozen=True, slots=True)
class EngineInfo:
    engine: str
    engine_version: str
    block_size: int
    num_device_blocks: int
    block_hash_encoding: str
    tiers: tuple[TierInfo, ...]
    actions: tuple[ActionSupport, ...]
    share_destinations: tuple[str, ...] = ()
    kv_cache_groups: tuple[KvCacheGroupInfo, ...] = ()
    # Data-parallel rank of this engine core and the group's size (0 and 1 without DP).
    data_parallel_rank: int = 0
    data_parallel_size: int = 1

    def supports(self, action: Action, kind: SelectorKind) -> ActionSupport | None:
        """The support entry if `action` accepts selector `kind`, else None."""
        for entry in self.actions:
            if entry.action is action:
                return entry if entry.supported and kind in entry.selectors else None
        return None
