"""EngineAdapter: the only thing the engine-neutral core knows about an engine.

An adapter lives inside the engine process. Two directions:
  * core -> engine: the methods below. All except `info` and
    `request_wakeup` are called on the engine thread at a scheduler step
    boundary (from `KvHintCore.run_pending`), never concurrently with the
    engine's own cache mutations.
  * engine -> core: the adapter reports every residency change through
    `KvHintCore` (`on_stored`, `on_removed`, `on_cleared`, `on_pin_broken`),
    synchronously on the engine thread, and calls `KvHintCore.run_pending()`
    at every step boundary and when woken while idle.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .model import BlockState, EngineInfo, HintSpec, Reason, Tier


@dataclass(frozen=True, slots=True)
class EvictReport:
    evicted: tuple[bytes, ...]
    in_use: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class TierRefusal:
    """Why a tier operation cannot start (UNSUPPORTED, RESOURCE_EXHAUSTED, ...)."""

    reason: Reason
    message: str


@dataclass(frozen=True, slots=True)
class TierTask:
    """A deferred tier operation handed to the adapter (Demote/Prefetch/Share)."""

    operation_id: str
    hint: HintSpec
    block_hashes: tuple[bytes, ...]


@runtime_checkable
class EngineAdapter(Protocol):
    def info(self) -> EngineInfo:
        """Static description of the engine (any thread)."""

    def request_wakeup(self) -> None:
        """Arrange for `KvHintCore.run_pending()` to run on the engine thread
        soon (within ~50 ms) even if the engine is idle (any thread)."""

    def lookup(self, hashes: Sequence[bytes]) -> dict[bytes, BlockState]:
        """Residency of explicit block hashes on every tier; absent hashes are
        left out."""

    def device_blocks(self) -> Iterable[BlockState]:
        """Every block resident on the device tier."""

    def device_groups(self, hashes: Sequence[bytes]) -> dict[bytes, int]:
        """Per block, which KV-cache groups (EngineInfo.kv_cache_groups) hold a
        device copy of it: a bitmask of `1 << group_id`; blocks with no device
        copy are left out. Only asked of engines that list a sliding-window
        group (kvhint_server.window_tails)."""

    def refile(self, hashes: Iterable[bytes]) -> None:
        """The effective retention class of these blocks changed; re-file
        their free device copies (ask the core for the class:
        `KvHintCore.retention(h)`). `hashes` come in the order they should
        become eviction candidates, a chain's tail first (callers with
        another order sort with `KvHintCore.tail_first`; a hash listed twice
        counts at its last place). The adapter keeps that order wherever a
        block lands: one that stays protected joins its class as the most
        recent, in the order given; one that becomes ordinary goes ahead of
        the ordinary eviction order, tail first (for a queue that takes one
        block at a time at its head: the given order reversed). So a chain's
        tail is given up before its root either way."""

    def demote_first(self, hashes: Iterable[bytes]) -> list[bytes]:
        """Make the free device copies of these blocks the first eviction
        candidates. Returns the blocks moved (those with a free device copy)."""

    def evict(self, hashes: Sequence[bytes]) -> EvictReport:
        """Free the device copies now, skipping blocks in use. Removals are
        reported through the core's hooks as usual."""

    def start_tier_task(self, task: TierTask) -> TierRefusal | None:
        """Begin Demote/Prefetch/Share work. Return None if it started (the
        adapter then completes `task.operation_id` exactly once through
        `KvHintCore.operations`), or why it cannot start: the hint is then
        REJECTED with that reason and the operation is discarded unseen. Only
        called for actions `info()` advertises."""


class DeviceOnlyTiers:
    """Mixin for adapters without lower tiers: tier actions are never advertised."""

    def start_tier_task(self, task: TierTask) -> TierRefusal | None:
        return TierRefusal(Reason.UNSUPPORTED, f"{task.hint.action.name} is not supported by this engine")


__all__ = ["BlockState", "DeviceOnlyTiers", "EngineAdapter", "EvictReport", "Tier", "TierRefusal", "TierTask"]
