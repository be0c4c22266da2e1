"""Typed results returned by the clients (dataclasses around the kvhint.v1 messages)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Optional

from kvhint.v1 import kvhint_pb2

from .names import outcome_name


@dataclass(frozen=True)
class ApplyResult:
    """The outcome of one ApplyHints call.

    `results[i]` belongs to `hints[i]` (the hints as sent, with client-assigned ids).
    Iterating, indexing and len() go over `results`.
    """

    hints: Sequence[kvhint_pb2.Hint]
    results: Sequence[kvhint_pb2.HintResult]
    epoch: str = ""
    applied_at_sequence: int = 0
    #: Engine steps whose hint-work budget ran out while the batch waited (server overload).
    deferred_steps: int = 0

    def __iter__(self) -> Iterator[kvhint_pb2.HintResult]:
        return iter(self.results)

    def __len__(self) -> int:
        return len(self.results)

    def __getitem__(self, index: int) -> kvhint_pb2.HintResult:
        return self.results[index]

    @property
    def outcomes(self) -> list[str]:
        """Outcome names in request order, e.g. ["ACCEPTED", "CLIPPED"]."""
        return [outcome_name(r.outcome) for r in self.results]

    @property
    def all_accepted(self) -> bool:
        """Every hint was applied in full (ACCEPTED)."""
        return all(r.outcome == kvhint_pb2.OUTCOME_ACCEPTED for r in self.results)

    @property
    def all_applied(self) -> bool:
        """Every hint was applied or queued (ACCEPTED, CLIPPED or DEFERRED)."""
        applied = (kvhint_pb2.OUTCOME_ACCEPTED, kvhint_pb2.OUTCOME_CLIPPED, kvhint_pb2.OUTCOME_DEFERRED)
        return all(r.outcome in applied for r in self.results)

    @property
    def by_outcome(self) -> dict[str, list[kvhint_pb2.HintResult]]:
        """Results grouped by outcome name ("ACCEPTED", ...), request order kept within a group."""
        groups: dict[str, list[kvhint_pb2.HintResult]] = {}
        for result in self.results:
            groups.setdefault(outcome_name(result.outcome), []).append(result)
        return groups

    @property
    def not_accepted(self) -> list[tuple[kvhint_pb2.Hint, kvhint_pb2.HintResult]]:
        """(hint, result) pairs whose outcome is not ACCEPTED."""
        return [(h, r) for h, r in zip(self.hints, self.results) if r.outcome != kvhint_pb2.OUTCOME_ACCEPTED]

    @property
    def operation_ids(self) -> list[str]:
        """Operation ids of DEFERRED hints, in request order."""
        return [r.operation_id for r in self.results if r.operation_id]

    def result_for(self, hint_id: str) -> Optional[kvhint_pb2.HintResult]:
        """The result of the hint with this id, if it was in the batch."""
        for hint, result in zip(self.hints, self.results):
            if hint.hint_id == hint_id:
                return result
        return None


@dataclass(frozen=True)
class Residency:
    """All pages of one QueryResidency, in chain order.

    `totals` (tier -> blocks over the whole selection) and the `as_of_*` position come from the
    last page read; `pages` is how many pages were fetched.
    """

    blocks: list[kvhint_pb2.BlockInfo] = field(default_factory=list)
    totals: dict[int, int] = field(default_factory=dict)
    as_of_epoch: str = ""
    as_of_sequence: int = 0
    pages: int = 0

    def hashes(self, tier: Optional[int] = None) -> list[bytes]:
        """Block hashes in chain order, optionally only those resident on `tier`."""
        return [b.block_hash for b in self.blocks if tier is None or tier in b.tiers]

    @property
    def total_blocks(self) -> int:
        return len(self.blocks)


@dataclass(frozen=True)
class HealthReport:
    """grpc.health.v1 status per service name ("" is the whole server).

    Status names are the HealthCheckResponse.ServingStatus names ("SERVING", "NOT_SERVING",
    "SERVICE_UNKNOWN", "UNKNOWN"); a service the health server does not know is "SERVICE_UNKNOWN".
    """

    statuses: dict[str, str]

    @property
    def serving(self) -> bool:
        """Every checked service reports SERVING."""
        return bool(self.statuses) and all(s == "SERVING" for s in self.statuses.values())
