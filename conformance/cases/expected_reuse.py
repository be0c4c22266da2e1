"""Expected reuse (RetainAction/PinAction.expected_reuse_in), observed as a user sees it.

Engines that advertise ActionSupport.supports_expected_reuse MUST order eviction among blocks of
the same retention class and priority by it (furthest expected reuse first, after blocks with no
or a passed expectation); engines that do not MUST reject a hint that sets it. Effects are
observed with `cached_tokens` after filler pressure, as in the retention cases (on a target with
lower tiers, with the device residency QueryResidency reports: retention.kept).
"""

from __future__ import annotations

import math
import time

from kvhint.v1 import kvhint_pb2 as pb

from .. import hints as H
from ..model import CaseSkipped, Registry, check
from ..target import CaseContext
from .retention import PRESSURE, kept

TTL = 120.0


def _supports(ctx: CaseContext, action: int) -> bool:
    return any(a.action == action and a.supported and a.supports_expected_reuse for a in ctx.caps.actions)


def retain_expecting(session_id: str, reuse_in: float, priority: int = 5) -> pb.Hint:
    h = H.retain(session_id, priority=priority, ttl=TTL)
    h.retain.expected_reuse_in.FromNanoseconds(int(reuse_in * 1e9))
    return h


def _half_session_pressure(ctx: CaseContext, sessions: int) -> None:
    """Fill the ordinary blocks plus about half of one session's blocks; skip when no prompt fits."""
    plan = ctx.plan
    bs, per = plan.block_size, plan.session_blocks
    filler_blocks = plan.overflow_filler(sessions)
    max_blocks = (ctx.target.options.max_model_len - 1) // bs
    if filler_blocks < 2 or filler_blocks > max_blocks:
        raise CaseSkipped(f"a filler of {filler_blocks} blocks is needed (at most {max_blocks} fit max_model_len)")
    ctx.pressure("expected-reuse", count=1, tokens=(filler_blocks - 1) * bs + max(1, bs // 2))


def _store(ctx: CaseContext, names: tuple[str, ...]) -> dict[str, list[int]]:
    prompts = {n: ctx.session_prompt(n) for n in names}
    for n in names:
        ctx.complete(prompts[n], ctx.sid(n))
    return prompts


def register(reg: Registry) -> None:
    @reg.case(
        "expected-reuse", "advertised-or-rejected",
        "A RETAIN or PIN that sets expected_reuse_in MUST be ACCEPTED when the engine advertises "
        "supports_expected_reuse for that action and MUST be REJECTED with UNSUPPORTED when it does not; a negative "
        "expected_reuse_in MUST be REJECTED with INVALID_HINT where it is supported.",
        requires=("retain:session", "pin:session"),
    )
    def advertised(ctx: CaseContext) -> None:
        name = ctx.sid("advertised")
        ctx.complete(ctx.small_prompt("advertised"), name)
        pin = H.pin(name, ttl=TTL)
        pin.pin.expected_reuse_in.FromNanoseconds(2 * 10**9)
        for action, h in ((pb.ACTION_RETAIN, retain_expecting(name, 2.0)), (pb.ACTION_PIN, pin)):
            result = ctx.apply_one(h)
            if _supports(ctx, action):
                check(result.outcome == pb.OUTCOME_ACCEPTED, f"{H.describe(result)}, expected ACCEPTED (advertised)")
                bad = retain_expecting(name, 2.0) if action == pb.ACTION_RETAIN else pin
                target = bad.retain if action == pb.ACTION_RETAIN else bad.pin
                target.expected_reuse_in.FromNanoseconds(-10**9)
                rejected = ctx.apply_one(bad)
                check(
                    rejected.outcome == pb.OUTCOME_REJECTED and rejected.reason == pb.REASON_INVALID_HINT,
                    f"negative expected_reuse_in: {H.describe(rejected)}, expected REJECTED/INVALID_HINT",
                )
            else:
                check(
                    result.outcome == pb.OUTCOME_REJECTED and result.reason == pb.REASON_UNSUPPORTED,
                    f"{H.describe(result)}, expected REJECTED/UNSUPPORTED (supports_expected_reuse not advertised)",
                )
        ctx.apply_one(H.release(name))

    @reg.case(
        "expected-reuse", "furthest-expected-reuse-evicted-first",
        "Among sessions retained at the same priority, the session whose expected_reuse_in is furthest in the "
        "future MUST lose blocks first, even when it is the most recently used: the sessions expected sooner MUST "
        "keep their whole prefix.",
        requires=("retain:session",),
        needs=PRESSURE,
    )
    def furthest_first(ctx: CaseContext) -> None:
        if not _supports(ctx, pb.ACTION_RETAIN):
            raise CaseSkipped("RETAIN does not advertise supports_expected_reuse")
        names = ("soon", "later", "far")  # oldest first: plain LRU would evict `soon` first
        prompts = _store(ctx, names)
        results = ctx.apply(
            retain_expecting(ctx.sid("soon"), 10.0), retain_expecting(ctx.sid("later"), 60.0), retain_expecting(ctx.sid("far"), 110.0)
        )
        check(all(r.outcome == pb.OUTCOME_ACCEPTED for r in results), "; ".join(H.describe(r) for r in results))
        _half_session_pressure(ctx, len(names))
        got = kept(ctx, prompts, ("soon", "later", "far"))
        soon, later, far = got["soon"], got["later"], got["far"]
        check(far < ctx.full_hit, f"the session expected furthest in the future kept all {far} tokens")
        check(
            soon == ctx.full_hit and later == ctx.full_hit,
            f"expected in 10 s hit {soon}, in 60 s hit {later} of {ctx.full_hit} tokens (in 110 s hit {far}): a session "
            "expected sooner lost blocks",
        )

    @reg.case(
        "expected-reuse", "passed-expectation-falls-back-to-lru",
        "Once a session's expected reuse time has passed, its expectation MUST NOT protect it beyond LRU order: "
        "among sessions retained at the same priority it MUST lose blocks before a session whose expected reuse is "
        "still in the future.",
        requires=("retain:session",),
        needs=PRESSURE,
    )
    def passed(ctx: CaseContext) -> None:
        if not _supports(ctx, pb.ACTION_RETAIN):
            raise CaseSkipped("RETAIN does not advertise supports_expected_reuse")
        names = ("overdue", "ahead", "further")  # oldest first
        prompts = _store(ctx, names)
        ctx.apply(
            retain_expecting(ctx.sid("overdue"), 1.0),
            retain_expecting(ctx.sid("ahead"), 100.0),
            retain_expecting(ctx.sid("further"), 110.0),
        )
        time.sleep(1.5)
        _half_session_pressure(ctx, len(names))
        got = kept(ctx, prompts, ("ahead", "further", "overdue"))
        ahead, further, overdue = got["ahead"], got["further"], got["overdue"]
        check(
            ahead == ctx.full_hit and further == ctx.full_hit,
            f"the sessions expected in 100 s and 110 s hit {ahead} and {further} of {ctx.full_hit} tokens",
        )
        check(overdue < ctx.full_hit, f"the session whose expected time passed kept all {overdue} tokens")

    @reg.case(
        "expected-reuse", "shared-block-uses-the-earliest-expectation",
        "A block retained by several sessions at the same priority MUST be ordered by the earliest expected reuse "
        "among their unexpired grants, whichever grant came first or last: a prefix that one of three sessions "
        "expects in 10 s, and the other two in 110 s, MUST outlast a session expected in 60 s.",
        requires=("retain:session",),
        needs=PRESSURE,
    )
    def shared_earliest(ctx: CaseContext) -> None:
        if not _supports(ctx, pb.ACTION_RETAIN):
            raise CaseSkipped("RETAIN does not advertise supports_expected_reuse")
        shared = ctx.session_prompt("shared")
        for n in ("first", "soon", "last"):  # one prompt, three sessions: the same blocks
            ctx.complete(shared, ctx.sid(n))
        prompts = {"soon": shared, **_store(ctx, ("near", "mid"))}
        # Sent in this order, "the first grant" and "the last grant" on the shared prefix both say
        # 110 s; only the earliest expectation says 10 s.
        results = ctx.apply(
            retain_expecting(ctx.sid("first"), 110.0),
            retain_expecting(ctx.sid("soon"), 10.0),
            retain_expecting(ctx.sid("last"), 110.0),
            retain_expecting(ctx.sid("near"), 35.0),
            retain_expecting(ctx.sid("mid"), 60.0),
        )
        check(all(r.outcome == pb.OUTCOME_ACCEPTED for r in results), "; ".join(H.describe(r) for r in results))
        _half_session_pressure(ctx, 3)
        got = kept(ctx, prompts, ("soon", "near", "mid"))
        check(
            got["soon"] == ctx.full_hit and got["near"] == ctx.full_hit,
            f"the prefix one session expects in 10 s (two others in 110 s) hit {got['soon']} and the session expected "
            f"in 35 s hit {got['near']} of {ctx.full_hit} tokens, the one expected in 60 s {got['mid']}: the shared "
            "prefix was not ranked by its earliest expectation",
        )
        check(got["mid"] < ctx.full_hit, f"the session expected in 60 s kept all {got['mid']} tokens: the pressure evicted nothing")
