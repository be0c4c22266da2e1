"""Where a `SessionPolicy` sends its hints, and how fast.

A sink takes a batch of `kvhint_pb2.Hint` and returns one `HintResult` per
hint, in order, or raises when it cannot say what became of some hint (the
RPC failed): `SessionPolicy.flush` then queues the batch again, under the same
hint ids, which servers deduplicate. `ClientSink` wraps `KvHintClient`,
`AsyncClientSink` wraps `AsyncKvHintClient`, `FleetSink` wraps `FleetClient`
(a hint counts as applied when any engine holding the session applied it;
it raises when an engine that might hold a hint failed). Tests use
`RecordingSink`.

`HintRateLimit` bounds the hint rate a policy sends at: at most `rate` hints
in any one-second interval, at most `burst` at once. (`TokenBucket`, kept for
callers of earlier versions, only bounds the average: a one-second interval
can hold `burst + rate` of its tokens.)
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from kvhint.v1 import kvhint_pb2 as pb

from ..errors import KvHintError

if TYPE_CHECKING:
    from ..client import AsyncKvHintClient, KvHintClient
    from ..fleet import FleetApplyResult, FleetClient

#: Outcome preference when engines of a fleet disagree (most applied first).
_OUTCOME_RANK = {pb.OUTCOME_ACCEPTED: 0, pb.OUTCOME_DEFERRED: 1, pb.OUTCOME_CLIPPED: 2, pb.OUTCOME_MISSING: 3, pb.OUTCOME_REJECTED: 4}


class HintSink(Protocol):
    def apply(self, hints: Sequence[pb.Hint]) -> Sequence[pb.HintResult]: ...


class AsyncHintSink(Protocol):
    async def apply(self, hints: Sequence[pb.Hint]) -> Sequence[pb.HintResult]: ...


class ClientSink:
    """Hints to one engine through `KvHintClient.apply`."""

    def __init__(self, client: KvHintClient, timeout: float | None = 5.0) -> None:
        self.client = client
        self.timeout = timeout

    def apply(self, hints: Sequence[pb.Hint]) -> Sequence[pb.HintResult]:
        return list(self.client.apply(*hints, timeout=self.timeout))


class AsyncClientSink:
    """Hints to one engine through `AsyncKvHintClient.apply`."""

    def __init__(self, client: AsyncKvHintClient, timeout: float | None = 5.0) -> None:
        self.client = client
        self.timeout = timeout

    async def apply(self, hints: Sequence[pb.Hint]) -> Sequence[pb.HintResult]:
        return list(await self.client.apply(*hints, timeout=self.timeout))


class FleetSink:
    """Hints to the engines of a fleet that hold each selected session (`FleetClient.apply`).

    Each hint's result is the most applied one among the engines (ACCEPTED >
    DEFERRED > CLIPPED > MISSING > REJECTED). MISSING ("no engine holds it")
    only when every engine answered and none holds the hint. `FleetClient.apply`
    reports engines that failed (routing or apply) in `errors` without raising;
    when that leaves the fate of any hint unknown (it was routed to an engine
    that failed, or no engine answered for it while some engine failed), this
    sink raises KvHintError (the first such engine's code, naming the hints and
    engines) instead of answering, so `SessionPolicy.flush` queues the batch
    again rather than marking the session cold and dropping the hint (a Release
    included). The resend reuses the hint ids: an engine that did apply a hint
    replays its first result."""

    def __init__(self, fleet: FleetClient, timeout: float | None = 5.0) -> None:
        self.fleet = fleet
        self.timeout = timeout

    def apply(self, hints: Sequence[pb.Hint]) -> Sequence[pb.HintResult]:
        result = self.fleet.apply(*hints, timeout=self.timeout)
        _raise_if_unknown(hints, result)
        out = []
        for hint in hints:
            per_engine = list(result.results_for(hint.hint_id).values())
            if not per_engine:
                out.append(pb.HintResult(hint_id=hint.hint_id, outcome=pb.OUTCOME_MISSING, message="no engine holds it"))
            else:
                out.append(min(per_engine, key=lambda r: _OUTCOME_RANK.get(r.outcome, 9)))
        return out


def _raise_if_unknown(hints: Sequence[pb.Hint], result: FleetApplyResult) -> None:
    """KvHintError when an engine that failed leaves the fate of some hint unknown (FleetSink)."""
    if not result.errors:
        return
    unknown: dict[str, list[str]] = {}  # hint_id -> the failed engines it may be on
    for hint in hints:
        failed = [e for e in result.routes.get(hint.hint_id, []) if e in result.errors]
        if not failed and not result.results_for(hint.hint_id):
            failed = list(result.errors)  # no engine answered for it: any failed engine may hold it
        if failed:
            unknown[hint.hint_id] = failed
    if not unknown:
        return
    engines = list(dict.fromkeys(e for failed in unknown.values() for e in failed))
    first = result.errors[engines[0]]
    raise KvHintError(
        first.code,
        f"FleetClient.apply left {len(unknown)} of {len(hints)} hints without a known result "
        f"({', '.join(repr(h) for h in list(unknown)[:5])}{', ...' if len(unknown) > 5 else ''}): "
        + "; ".join(f"engine {e!r} failed: {result.errors[e]}" for e in engines),
        method=first.method,
        address=first.address,
    ) from first


class RecordingSink:
    """Keeps every batch; answers with `respond(hint)` (default ACCEPTED)."""

    def __init__(self, respond: Callable[[pb.Hint], pb.HintResult] | None = None) -> None:
        self.batches: list[list[pb.Hint]] = []
        self.respond = respond or (lambda h: pb.HintResult(hint_id=h.hint_id, outcome=pb.OUTCOME_ACCEPTED))

    @property
    def hints(self) -> list[pb.Hint]:
        return [h for batch in self.batches for h in batch]

    def apply(self, hints: Sequence[pb.Hint]) -> Sequence[pb.HintResult]:
        self.batches.append(list(hints))
        return [self.respond(h) for h in hints]


class TokenBucket:
    """`rate` tokens per second, at most `burst` stored; time is passed in, so it is testable."""

    def __init__(self, rate: float, burst: float) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("rate must be > 0 and burst >= 1")
        self.rate = rate
        self.burst = float(burst)
        self.tokens = float(burst)
        self._at: float | None = None

    def available(self, now: float) -> int:
        """Whole tokens available at `now` (time never moves backwards here)."""
        if self._at is None:
            self._at = now
        elif now > self._at:
            self.tokens = min(self.burst, self.tokens + (now - self._at) * self.rate)
            self._at = now
        return int(self.tokens)

    def take(self, n: int, now: float) -> int:
        """Take up to `n` tokens at `now`; returns how many were taken."""
        got = min(n, self.available(now))
        self.tokens -= got
        return got


class HintRateLimit:
    """At most `rate` hints in any one-second interval (half-open: [t, t + 1)), and at most
    `burst` taken in one call. A rate below 1 allows one hint per 1/rate seconds instead.
    A sliding window over the send times of the last interval (at most `rate` entries);
    time is passed in, so it is testable, and never moves backwards here."""

    def __init__(self, rate: float, burst: float) -> None:
        if not rate > 0 or not math.isfinite(rate) or not burst >= 1:
            raise ValueError(f"rate must be a finite number > 0 and burst >= 1 (got rate={rate!r}, burst={burst!r})")
        self.rate = rate
        self.burst = int(burst)
        self.window_s = max(1.0, 1.0 / rate)
        self.limit = max(1, int(rate * self.window_s + 1e-9))
        self._sent: deque[float] = deque()

    def available(self, now: float) -> int:
        """How many hints may go at `now`."""
        sent, start = self._sent, now - self.window_s
        while sent and sent[0] <= start:
            sent.popleft()
        return min(self.burst, self.limit - len(sent))

    def take(self, n: int, now: float) -> int:
        """Take up to `n` sends at `now`; returns how many were taken."""
        got = max(0, min(n, self.available(now)))
        self._sent.extend([now] * got)
        return got
