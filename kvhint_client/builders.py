"""Selector and hint builders.

    session("S").pin(ttl=30)
    session("S", include_children=True).retain(priority=5, ttl=60)
    continuation("c1").evict()
    blocks(h1, h2).release()
    session("S").range(0, 4).demote(target_tier="host")
    session("S").share("10.0.0.7:50151")
    session("S").prefetch(deadline=5)

`session()`, `continuation()` and `blocks()` return an immutable Target; its action methods
return a `kvhint_pb2.Hint`. Every method validates what the proto defines as malformed (empty
or over-long ids, ttl <= 0, an empty or reversed range, a range on block hashes, ...) and raises
ValueError saying which argument is wrong. Bounds the server decides (max_ttl, pin budget,
batch size) are left to the server. TTLs accept seconds (int/float) or a timedelta.

Block hashes are bytes (1..64). For convenience `blocks()` also takes a hex string (optional
"0x" prefix) or an int, which becomes its 8-byte big-endian encoding, the proto's encoding of
vLLM's 64-bit integer hashes (Dynamo routers carry those ints).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional, Union

from google.protobuf import duration_pb2

from kvhint.v1 import kvhint_pb2

from .durations import Seconds, to_duration
from .names import TierLike, parse_event_kind, parse_tier

BlockHashLike = Union[bytes, bytearray, memoryview, str, int]

# Id lengths are the server's (GetCapabilities limits.max_id_length and
# max_hint_id_length): the clients check them before sending once they know
# them (_rpc.check_limits); builders check only that an id is non-empty text.
MAX_HASH_BYTES = 64
_UINT32_MAX = 2**32 - 1
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def _check_id(value: str, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{what} must not be empty")
    return value


def block_hash(value: BlockHashLike) -> bytes:
    """One block hash as bytes: bytes as given, hex strings decoded, ints as 8-byte big-endian."""
    if isinstance(value, bool):
        raise ValueError(f"block hash must be bytes, hex or int, got {value!r}")
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
    elif isinstance(value, int):
        if not -(2**63) <= value < 2**64:
            raise ValueError(f"integer block hash {value} does not fit in 64 bits")
        raw = (value % 2**64).to_bytes(8, "big")
    elif isinstance(value, str):
        text = value[2:] if value[:2].lower() == "0x" else value
        try:
            raw = bytes.fromhex(text)
        except ValueError:
            raise ValueError(f"block hash {value!r} is not hexadecimal") from None
    else:
        raise ValueError(f"block hash must be bytes, hex or int, got {type(value).__name__}")
    if not 1 <= len(raw) <= MAX_HASH_BYTES:
        raise ValueError(f"block hash must be 1..{MAX_HASH_BYTES} bytes, got {len(raw)}")
    return raw


def _expected_reuse(value: Seconds) -> duration_pb2.Duration:
    """expected_reuse_in as a Duration; negative values raise ValueError."""
    duration = to_duration(value, name="expected_reuse_in", positive=False)
    if duration.seconds < 0 or duration.nanos < 0:
        raise ValueError(f"expected_reuse_in must be >= 0 seconds, got {value!r}")
    return duration


def _check_uint32(value: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _UINT32_MAX:
        raise ValueError(f"{what} must be an integer in [0, {_UINT32_MAX}], got {value!r}")
    return value


@dataclass(frozen=True)
class Target:
    """An immutable selector: exactly one of session / continuation / block hashes, plus an
    optional half-open range of chain positions. Build with session(), continuation(), blocks()."""

    session_id: Optional[str] = None
    include_children: bool = False
    continuation_id: Optional[str] = None
    block_hashes: tuple[bytes, ...] = ()
    range_start: Optional[int] = None
    range_end: Optional[int] = None

    def __post_init__(self) -> None:
        kinds = sum((self.session_id is not None, self.continuation_id is not None, bool(self.block_hashes)))
        if kinds != 1:
            raise ValueError("a selector needs exactly one of session, continuation or block hashes")
        if self.include_children and self.session_id is None:
            raise ValueError("include_children applies to session selectors only")
        if self.range_start is None and self.range_end is not None:
            raise ValueError("a range needs a start")
        if self.range_start is not None:
            if self.block_hashes:
                raise ValueError("a range cannot narrow a block-hash selector")
            _check_uint32(self.range_start, "range start")
            if self.range_end is not None:
                _check_uint32(self.range_end, "range end")
                if self.range_end <= self.range_start:
                    raise ValueError(f"range end ({self.range_end}) must be greater than start ({self.range_start})")

    # -- selector ---------------------------------------------------------------------------

    def range(self, start: int, end: Optional[int] = None) -> "Target":
        """Narrow to chain positions [start, end); `end=None` means to the end of the chain."""
        return dataclasses.replace(self, range_start=start, range_end=end)

    @property
    def selector(self) -> kvhint_pb2.Selector:
        """A fresh kvhint_pb2.Selector for this target."""
        selector = kvhint_pb2.Selector()
        if self.session_id is not None:
            selector.session.session_id = self.session_id
            selector.session.include_children = self.include_children
        elif self.continuation_id is not None:
            selector.continuation.continuation_id = self.continuation_id
        else:
            selector.block_hashes.block_hashes.extend(self.block_hashes)
        if self.range_start is not None:
            selector.range.start = self.range_start
            if self.range_end is not None:
                selector.range.end = self.range_end
        return selector

    @classmethod
    def from_selector(cls, selector: kvhint_pb2.Selector) -> "Target":
        """The Target equivalent of a Selector (validated like the builders)."""
        target = selector.WhichOneof("target")
        start = end = None
        if selector.HasField("range"):
            start = selector.range.start
            end = selector.range.end if selector.range.HasField("end") else None
        if target == "session":
            return cls(
                session_id=_check_id(selector.session.session_id, "session_id"),
                include_children=selector.session.include_children,
                range_start=start,
                range_end=end,
            )
        if target == "continuation":
            return cls(
                continuation_id=_check_id(selector.continuation.continuation_id, "continuation_id"),
                range_start=start,
                range_end=end,
            )
        if target == "block_hashes":
            hashes = tuple(block_hash(h) for h in selector.block_hashes.block_hashes)
            if not hashes:
                raise ValueError("a block-hash selector needs at least one hash")
            return cls(block_hashes=hashes, range_start=start, range_end=end)
        raise ValueError("selector has no target (session, continuation or block_hashes)")

    # -- actions ------------------------------------------------------------------------------

    def _hint(self, hint_id: Optional[str], max_blocks: int) -> kvhint_pb2.Hint:
        hint = kvhint_pb2.Hint(selector=self.selector, max_blocks=_check_uint32(max_blocks, "max_blocks"))
        if hint_id is not None:
            hint.hint_id = _check_id(hint_id, "hint_id")
        return hint

    def retain(
        self,
        ttl: Seconds,
        priority: int = 0,
        *,
        expected_reuse_in: Optional[Seconds] = None,
        hint_id: Optional[str] = None,
        max_blocks: int = 0,
    ) -> kvhint_pb2.Hint:
        """Bias eviction: keep these blocks longer than ordinary ones (higher priority kept longer).

        `expected_reuse_in` (>= 0 s): when the caller expects to read the blocks again; among
        blocks of the same priority the engine evicts the furthest expected reuse first (engines
        advertise it as ActionSupport.supports_expected_reuse)."""
        if isinstance(priority, bool) or not isinstance(priority, int) or not _INT32_MIN <= priority <= _INT32_MAX:
            raise ValueError(f"priority must be a 32-bit integer, got {priority!r}")
        hint = self._hint(hint_id, max_blocks)
        hint.retain.priority = priority
        hint.retain.ttl.CopyFrom(to_duration(ttl, name="ttl"))
        if expected_reuse_in is not None:
            hint.retain.expected_reuse_in.CopyFrom(_expected_reuse(expected_reuse_in))
        return hint

    def pin(
        self,
        ttl: Seconds,
        *,
        expected_reuse_in: Optional[Seconds] = None,
        hint_id: Optional[str] = None,
        max_blocks: int = 0,
    ) -> kvhint_pb2.Hint:
        """Protect from ordinary eviction for `ttl` (within the engine's pin budget).

        `expected_reuse_in` as for retain(): it orders which pins break first under pressure."""
        hint = self._hint(hint_id, max_blocks)
        hint.pin.ttl.CopyFrom(to_duration(ttl, name="ttl"))
        if expected_reuse_in is not None:
            hint.pin.expected_reuse_in.CopyFrom(_expected_reuse(expected_reuse_in))
        return hint

    def release(self, *, hint_id: Optional[str] = None, max_blocks: int = 0) -> kvhint_pb2.Hint:
        """Drop this selection's retention and pins."""
        hint = self._hint(hint_id, max_blocks)
        hint.release.SetInParent()
        return hint

    def evict(self, *, hint_id: Optional[str] = None, max_blocks: int = 0) -> kvhint_pb2.Hint:
        """Free the selected cached blocks now (blocks in use or pinned by others are skipped)."""
        hint = self._hint(hint_id, max_blocks)
        hint.evict.SetInParent()
        return hint

    def demote(
        self, target_tier: Optional[TierLike] = None, *, hint_id: Optional[str] = None, max_blocks: int = 0
    ) -> kvhint_pb2.Hint:
        """Ensure a lower-tier copy (default: the nearest lower tier), then let the device copy go."""
        hint = self._hint(hint_id, max_blocks)
        hint.demote.SetInParent()
        if target_tier is not None:
            hint.demote.target_tier = parse_tier(target_tier)
        return hint

    def prefetch(
        self, deadline: Optional[Seconds] = None, *, hint_id: Optional[str] = None, max_blocks: int = 0
    ) -> kvhint_pb2.Hint:
        """Bring lower-tier copies toward the device tier; abandon after `deadline` if given."""
        hint = self._hint(hint_id, max_blocks)
        hint.prefetch.SetInParent()
        if deadline is not None:
            hint.prefetch.deadline.CopyFrom(to_duration(deadline, name="deadline"))
        return hint

    def share(self, destination: str, *, hint_id: Optional[str] = None, max_blocks: int = 0) -> kvhint_pb2.Hint:
        """Make the selected KV available on `destination` (a peer "host:port" or a shared tier name)."""
        hint = self._hint(hint_id, max_blocks)
        hint.share.destination = _check_id(destination, "destination")
        return hint


def session(session_id: str, include_children: bool = False) -> Target:
    """All blocks of a session (and, with include_children, of its child sessions)."""
    return Target(session_id=_check_id(session_id, "session_id"), include_children=bool(include_children))


def continuation(continuation_id: str) -> Target:
    """The prefix chain ending at a continuation position."""
    return Target(continuation_id=_check_id(continuation_id, "continuation_id"))


def blocks(*hashes: BlockHashLike) -> Target:
    """Explicit block hashes (bytes, hex strings, or 64-bit ints); duplicates are dropped."""
    if len(hashes) == 1 and not isinstance(hashes[0], (bytes, bytearray, memoryview, str, int)):
        try:
            hashes = tuple(hashes[0])  # blocks(list_of_hashes)
        except TypeError:  # one value that is neither a hash nor a list of them (None, 1.5)
            raise ValueError(f"block hash must be bytes, hex or int, got {type(hashes[0]).__name__}") from None
    unique = tuple(dict.fromkeys(block_hash(h) for h in hashes))
    if not unique:
        raise ValueError("blocks() needs at least one block hash")
    return Target(block_hashes=unique)


SelectorLike = Union[Target, kvhint_pb2.Selector]


def as_selector(selector: SelectorLike) -> kvhint_pb2.Selector:
    """A kvhint_pb2.Selector from a Target or a Selector (copied)."""
    if isinstance(selector, Target):
        return selector.selector
    if isinstance(selector, kvhint_pb2.Selector):
        copy = kvhint_pb2.Selector()
        copy.CopyFrom(selector)
        return copy
    raise ValueError(f"expected a Target (session()/continuation()/blocks()) or a Selector, got {type(selector).__name__}")


def event_filter(
    sessions: Iterable[str] = (),
    tiers: Iterable[TierLike] = (),
    kinds: Iterable[Union[int, str]] = (),
) -> kvhint_pb2.EventFilter:
    """An EventFilter; kinds accept EventKind values or names like "blocks_stored"."""
    return kvhint_pb2.EventFilter(
        session_ids=[_check_id(s, "session_id") for s in sessions],
        tiers=[parse_tier(t) for t in tiers],
        kinds=[parse_event_kind(k) if isinstance(k, str) else kvhint_pb2.EventKind.ValueType(k) for k in kinds],
    )
