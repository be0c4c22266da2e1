"""WatchEvents completeness: an unfiltered subscription sees every event, with no sequence gap."""

from __future__ import annotations

from .. import hints as H
from ..model import Registry, check
from ..target import CaseContext
from ..watch import CONTROL

# Cheap hint batches published during the case (Releases of sessions that do not exist: MISSING,
# each one HintApplied event).
PROBE_BATCHES = 3
PROBE_HINTS = 8


def register(reg: Registry) -> None:
    @reg.case(
        "events", "unfiltered-stream-gap-free",
        "An unfiltered WatchEvents subscription MUST deliver every event: after the latest sequence its first "
        "heartbeat reports, the event sequences it receives MUST be consecutive (no gap, no repeat) across engine "
        "traffic (stored and removed blocks) and applied hints.",
        requires=("release:session",),
    )
    def gap_free(ctx: CaseContext) -> None:
        watch = ctx.watch_now()
        first = watch.messages[0]
        start = first.sequence if first.WhichOneof("payload") in CONTROL else first.sequence - 1
        traffic, _reason = ctx.target.need("traffic")
        hinted = 0
        if traffic:  # stored and (under a little pressure) removed blocks, then hints on the session
            session = ctx.sid("g")
            ctx.complete(ctx.session_prompt("g"), session, continuation_id=ctx.cid("g"))
            ctx.pressure("gap-free", count=2)
            have = ctx.target.capabilities
            hints = [H.retain(session, priority=1, ttl=30)] if "retain:session" in have else []
            hints += [H.pin(session, ttl=30)] if "pin:session" in have else []
            ctx.apply(*hints, H.release(session))
            hinted += len(hints) + 1
        per_batch = max(1, min(PROBE_HINTS, ctx.caps.limits.max_hints_per_batch or PROBE_HINTS))
        for b in range(PROBE_BATCHES):
            ctx.apply(*(H.release(ctx.sid(f"absent-{b}-{i}")) for i in range(per_batch)))
            hinted += per_batch
        target = ctx.latest_sequence()
        watch.wait_sequence(target)
        seqs = [m.sequence for m in watch.stop() if m.WhichOneof("payload") not in CONTROL and m.sequence <= target]
        expected = list(range(start + 1, target + 1))
        check(seqs, f"no event on an unfiltered subscription after {hinted + 1} applied hints"
                    f"{' and session traffic' if traffic else ''} (sequence {start} -> {target})")
        missing = sorted(set(expected) - set(seqs))
        check(not missing, f"{len(missing)} of the {len(expected)} sequences {start + 1}..{target} never arrived "
                           f"(e.g. {missing[:5]}); an unfiltered stream must have no gap")
        check(seqs == expected, f"sequences {start + 1}..{target} arrived repeated or out of order: "
                                f"{[s for s, e in zip(seqs, expected) if s != e][:5]}")
