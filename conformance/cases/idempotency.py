"""Idempotent hint ids."""

from __future__ import annotations

from kvhint.v1 import kvhint_pb2 as pb

from .. import hints as H
from ..model import Registry, check
from ..target import CaseContext
from .outcomes import resident_selection


def _pinned(ctx: CaseContext, session: str) -> int:
    return sum(1 for b in ctx.residency(H.session_selector(session)) if b.retention.retention_class == pb.RetentionState.CLASS_PINNED)


def register(reg: Registry) -> None:
    @reg.case(
        "idempotency", "replay-returns-first-result",
        "Re-sending a hint with a hint_id the target has already seen MUST return the first result (same outcome and "
        "affected blocks) with replayed set; the first result MUST NOT have replayed set.",
        requires=("pin:session",),
        needs=("traffic",),
    )
    def replay(ctx: CaseContext) -> None:
        sel, n, _p, _s = resident_selection(ctx, "session")
        hint = H.hint(sel, "pin", ttl=30, hint_id=ctx.sid("idem"))
        first = ctx.apply_one(hint)
        again = ctx.apply_one(hint)
        check(not first.replayed, f"the first application is marked replayed: {H.describe(first)}")
        check(again.replayed, f"the re-sent hint_id is not marked replayed: {H.describe(again)}")
        check(
            again.outcome == first.outcome and H.device_blocks(again) == H.device_blocks(first) and again.hint_id == first.hint_id,
            f"replayed result {H.describe(again)} differs from the first {H.describe(first)}",
        )

    @reg.case(
        "idempotency", "replay-is-not-applied-again",
        "A re-sent hint_id MUST NOT apply the hint again: an EVICT re-sent with the same hint_id after its session "
        "was stored again MUST be replayed and leave the session's blocks resident.",
        requires=("evict:session",),
        needs=("cached-tokens",),
    )
    def not_again(ctx: CaseContext) -> None:
        sel, n, prompt, session = resident_selection(ctx, "session")
        hint = H.hint(sel, "evict", hint_id=ctx.sid("once"))
        first = ctx.apply_one(hint)
        check(first.outcome == pb.OUTCOME_ACCEPTED, f"evict: {H.describe(first)}, expected ACCEPTED")
        ctx.complete(prompt, session)  # stored again
        again = ctx.apply_one(hint)
        check(again.replayed, f"re-sent hint_id: {H.describe(again)}, expected replayed")
        left = ctx.device_hashes(sel)
        check(len(left) == n, f"after the replayed evict, {len(left)} of {n} blocks are on the device tier: it was applied again")
        hit = ctx.complete(prompt, session).cached_tokens
        full = n * ctx.plan.block_size
        check(hit == full, f"after the replayed evict, a repeat hit {hit} tokens, expected {full}: it was applied again")

    @reg.case(
        "idempotency", "conflicting-reuse-rejected",
        "Re-using a hint_id for a different hint MUST get REJECTED with REASON_HINT_ID_CONFLICT and MUST NOT apply it.",
        requires=("pin:session",),
        needs=("traffic",),
    )
    def conflict(ctx: CaseContext) -> None:
        sel, n, _p, session = resident_selection(ctx, "session")
        other_sel, _n2, _p2, other = resident_selection(ctx, "session", name="other")
        hint_id = ctx.sid("conflict")
        ctx.apply_one(H.hint(sel, "pin", ttl=30, hint_id=hint_id))
        clash = ctx.apply_one(H.hint(other_sel, "pin", ttl=30, hint_id=hint_id))
        check(
            clash.outcome == pb.OUTCOME_REJECTED and clash.reason == pb.REASON_HINT_ID_CONFLICT,
            f"same hint_id, different hint: {H.describe(clash)}, expected REJECTED/HINT_ID_CONFLICT",
        )
        check(_pinned(ctx, other) == 0, "the conflicting hint was applied (its session is pinned)")

    @reg.case(
        "idempotency", "hints-without-id-not-deduplicated",
        "Hints without a hint_id MUST never be deduplicated: the same EVICT sent twice without an id MUST be applied "
        "both times (neither result replayed).",
        requires=("evict:session",),
        needs=("cached-tokens",),
    )
    def no_id(ctx: CaseContext) -> None:
        sel, n, prompt, session = resident_selection(ctx, "session")
        hint = H.hint(sel, "evict")
        first = ctx.apply_one(hint)
        ctx.complete(prompt, session)  # stored again
        second = ctx.apply_one(hint)
        check(not first.replayed and not second.replayed, f"a hint without an id was replayed: {H.describe(second)}")
        check(
            second.outcome == pb.OUTCOME_ACCEPTED and H.device_blocks(second) == n,
            f"the second identical evict without an id: {H.describe(second)}, expected ACCEPTED with {n} blocks",
        )
        left = ctx.device_hashes(sel)
        check(not left, f"after the second evict, {len(left)} blocks are still on the device tier")
        if not ctx.lower_tiers:
            hit = ctx.complete(prompt, session).cached_tokens
            check(hit == 0, f"after the second evict, a repeat hit {hit} tokens, expected 0")
