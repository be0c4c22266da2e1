"""Every action x selector the target advertises: each outcome kind it can produce.

Local actions (Retain, Pin, Release, Evict): ACCEPTED on a resident selection, MISSING on
nothing resident. Tier actions (Demote, Prefetch, Share): DEFERRED with an operation the
target can report, an ACCEPTED no-op (Prefetch of device-resident blocks), MISSING, and
REJECTED/UNKNOWN_DESTINATION (Share). UNSUPPORTED for the rest lives in capabilities.py.

Every result these cases examine must also keep the HintResult form (target.check_result_form):
affected_blocks holds at most one entry per tier, in Tier order, each with blocks > 0, and the
reason is REASON_UNSPECIFIED for ACCEPTED and DEFERRED.
"""

from __future__ import annotations

import grpc

from kvhint.v1 import kvhint_pb2 as pb

from .. import hints as H
from ..model import CaseFailed, Registry, check
from ..target import CaseContext, check_result_form, poll, rpc_error_text

LOCAL = ("retain", "pin", "release", "evict")
SMALL_BLOCKS = 3


def resident_selection(ctx: CaseContext, kind: str, name: str = "s", blocks: int = SMALL_BLOCKS) -> tuple[pb.Selector, int, list[int], str]:
    """Store a small session prompt and return (selector of `kind` over it, its block count,
    the prompt, the session id). The prompt keeps every block resident: on a sliding-window-only
    engine it is at most a window tail long (Plan.resident_blocks)."""
    blocks = ctx.plan.resident_blocks(blocks)
    session = ctx.sid(name)
    prompt = ctx.small_prompt(name, blocks)
    ctx.complete(prompt, session, continuation_id=ctx.cid(name))
    hashes = ctx.device_hashes(H.session_selector(session))
    check(
        len(hashes) == blocks,
        f"after one {len(prompt)}-token request of session {session}, QueryResidency reports {len(hashes)} device "
        f"blocks, expected {blocks}",
    )
    if kind == "session":
        sel = H.session_selector(session)
    elif kind == "continuation":
        sel = H.continuation_selector(ctx.cid(name))
    else:
        sel = H.hashes_selector(hashes)
    return sel, blocks, prompt, session


def absent_selection(ctx: CaseContext, kind: str) -> pb.Selector:
    if kind == "session":
        return H.session_selector(ctx.sid("never-seen"))
    if kind == "continuation":
        return H.continuation_selector(ctx.cid("never-seen"))
    width = 8 if ctx.caps.block_hash_encoding == "int64" else 32
    seed = ctx.tokens("absent-hash", width)
    return H.hashes_selector([bytes(t % 251 + 1 for t in seed)])


def _a(action: str) -> str:
    return "An" if action[0] in "aeiou" else "A"


def register(reg: Registry) -> None:
    for action in LOCAL:
        for kind in H.SELECTORS:
            _accepted(reg, action, kind)
            _missing(reg, action, kind)
    for kind in H.SELECTORS:
        _demote(reg, kind)
        _prefetch(reg, kind)
        _share(reg, kind)

    @reg.case(
        "outcomes", "share-unknown-destination-rejected",
        "A SHARE hint whose destination is not one of GetCapabilities.share_destinations MUST get REJECTED with "
        "REASON_UNKNOWN_DESTINATION.",
        requires=("share:session",),
    )
    def share_unknown(ctx: CaseContext) -> None:
        bogus = "kvhint-conformance-unknown-peer:1"
        check(bogus not in ctx.caps.share_destinations, "the bogus destination is configured")
        result = ctx.apply_one(H.hint(H.session_selector(ctx.sid("x")), "share", destination=bogus))
        check_result_form(result, "SHARE to an unknown destination")
        check(
            result.outcome == pb.OUTCOME_REJECTED and result.reason == pb.REASON_UNKNOWN_DESTINATION,
            f"SHARE to an unknown destination: {H.describe(result)}, expected REJECTED/UNKNOWN_DESTINATION",
        )

    @reg.case(
        "outcomes", "results-in-request-order",
        "ApplyHints MUST return exactly one result per hint, in request order, each echoing its hint_id, with a "
        "non-UNSPECIFIED outcome.",
        requires=("release:session",),
    )
    def in_order(ctx: CaseContext) -> None:
        batch = [H.release(ctx.sid(f"n{i}"), hint_id=f"{ctx.sid('order')}-{i}") for i in range(5)]
        batch.insert(2, pb.Hint(hint_id=f"{ctx.sid('order')}-bad", selector=H.session_selector(ctx.sid("x"))))  # no action
        results = ctx.apply(*batch)
        check([r.hint_id for r in results] == [h.hint_id for h in batch], f"hint ids {[r.hint_id for r in results]} are not echoed in request order")
        check(all(r.outcome != pb.OUTCOME_UNSPECIFIED for r in results), "a result has OUTCOME_UNSPECIFIED")
        for i, r in enumerate(results):
            check_result_form(r, f"result {i}")
        check(results[2].outcome == pb.OUTCOME_REJECTED, f"the hint without an action got {H.describe(results[2])}")


def _accepted(reg: Registry, action: str, kind: str) -> None:
    @reg.case(
        "outcomes", f"{action}-{kind}-accepted",
        f"{_a(action)} {action.upper()} hint with a {kind} selector that resolves to resident device blocks MUST get ACCEPTED"
        + (" and report the blocks it applied to in affected_blocks" if action != "release" else "")
        + (" and the granted TTL in effective_ttl" if action in ("retain", "pin") else "")
        + ", with REASON_UNSPECIFIED and affected_blocks holding at most one entry per tier, in Tier order, each with "
        "blocks > 0.",
        requires=(f"{action}:{kind}",),
        needs=("traffic",),
    )
    def accepted(ctx: CaseContext) -> None:
        sel, blocks, _prompt, _session = resident_selection(ctx, kind)
        result = ctx.apply_one(H.hint(sel, action, ttl=30, priority=3))
        check(result.outcome == pb.OUTCOME_ACCEPTED, f"{action} of {blocks} resident blocks by {kind}: {H.describe(result)}, expected ACCEPTED")
        check_result_form(result, f"{action} of {blocks} resident blocks by {kind}")
        if action != "release":
            got = H.device_blocks(result)
            check(got == blocks, f"{action} by {kind}: affected_blocks reports {got} device blocks, expected {blocks}")
        if action in ("retain", "pin"):
            check(result.effective_ttl.seconds == 30, f"effective_ttl={result.effective_ttl.seconds}s for a 30s TTL")


def _missing(reg: Registry, action: str, kind: str) -> None:
    @reg.case(
        "outcomes", f"{action}-{kind}-missing",
        f"{_a(action)} {action.upper()} hint with a {kind} selector that resolves to nothing resident MUST get MISSING with "
        "REASON_NOT_RESIDENT, and MUST NOT be reported as ACCEPTED.",
        requires=(f"{action}:{kind}",),
    )
    def missing(ctx: CaseContext) -> None:
        result = ctx.apply_one(H.hint(absent_selection(ctx, kind), action, ttl=30))
        check(
            result.outcome == pb.OUTCOME_MISSING and result.reason == pb.REASON_NOT_RESIDENT,
            f"{action} of a {kind} selector that names nothing resident: {H.describe(result)}, expected MISSING/NOT_RESIDENT",
        )
        check_result_form(result, f"{action} of a {kind} selector that names nothing resident")


def _get_operation(ctx: CaseContext, operation_id: str) -> pb.Operation:
    try:
        return ctx.stub.GetOperation(pb.GetOperationRequest(operation_id=operation_id), timeout=ctx.timeout).operation
    except grpc.RpcError as err:
        raise CaseFailed(f"GetOperation({operation_id!r}) failed: {rpc_error_text(err)}") from err


def wait_operation(ctx: CaseContext, operation_id: str, timeout: float = 60.0) -> pb.Operation:
    last: list[pb.Operation] = []

    def done() -> bool:
        op = _get_operation(ctx, operation_id)
        last[:] = [op]
        return op.state in (pb.Operation.STATE_SUCCEEDED, pb.Operation.STATE_FAILED)

    poll(done, timeout, 0.1)
    return last[0]


def _deferred_checks(ctx: CaseContext, action: str, result: pb.HintResult, wait: bool) -> None:
    check(result.outcome == pb.OUTCOME_DEFERRED, f"{action}: {H.describe(result)}, expected DEFERRED")
    check_result_form(result, action)
    check(result.operation_id, f"{action}: DEFERRED without an operation_id")
    op = _get_operation(ctx, result.operation_id)
    check(op.operation_id == result.operation_id, f"GetOperation returned operation {op.operation_id!r}")
    check(op.action == H.ACTION_ENUM[action], f"GetOperation reports action {pb.Action.Name(op.action)}")
    if wait:
        op = wait_operation(ctx, result.operation_id)
        check(
            op.state == pb.Operation.STATE_SUCCEEDED,
            f"{action} operation ended {pb.Operation.State.Name(op.state)} ({H.reason_name(op.reason)}: {op.message})",
        )
        check(op.completed_at.seconds > 0, "a finished operation has no completed_at")


def _demote(reg: Registry, kind: str) -> None:
    @reg.case(
        "outcomes", f"demote-{kind}-deferred",
        f"A DEMOTE hint with a {kind} selector over resident device blocks MUST get DEFERRED (REASON_UNSPECIFIED) with "
        "an operation_id that GetOperation reports, and the operation MUST reach SUCCEEDED.",
        requires=(f"demote:{kind}",),
        needs=("traffic",),
    )
    def deferred(ctx: CaseContext) -> None:
        sel, _blocks, _p, _s = resident_selection(ctx, kind)
        _deferred_checks(ctx, "demote", ctx.apply_one(H.hint(sel, "demote")), wait=True)

    @reg.case(
        "outcomes", f"demote-{kind}-missing",
        f"A DEMOTE hint with a {kind} selector that resolves to nothing resident MUST get MISSING.",
        requires=(f"demote:{kind}",),
    )
    def missing(ctx: CaseContext) -> None:
        result = ctx.apply_one(H.hint(absent_selection(ctx, kind), "demote"))
        check(result.outcome == pb.OUTCOME_MISSING, f"demote of nothing resident: {H.describe(result)}, expected MISSING")
        check_result_form(result, "demote of nothing resident")


def _prefetch(reg: Registry, kind: str) -> None:
    @reg.case(
        "outcomes", f"prefetch-{kind}-accepted-when-resident",
        f"A PREFETCH hint with a {kind} selector whose blocks are all on the device tier MUST be an ACCEPTED no-op.",
        requires=(f"prefetch:{kind}",),
        needs=("traffic",),
    )
    def noop(ctx: CaseContext) -> None:
        sel, _blocks, _p, _s = resident_selection(ctx, kind)
        result = ctx.apply_one(H.hint(sel, "prefetch"))
        check(result.outcome == pb.OUTCOME_ACCEPTED, f"prefetch of device-resident blocks: {H.describe(result)}, expected ACCEPTED")
        check_result_form(result, "prefetch of device-resident blocks")

    @reg.case(
        "outcomes", f"prefetch-{kind}-missing",
        f"A PREFETCH hint with a {kind} selector that resolves to nothing resident on any tier MUST get MISSING.",
        requires=(f"prefetch:{kind}",),
    )
    def missing(ctx: CaseContext) -> None:
        result = ctx.apply_one(H.hint(absent_selection(ctx, kind), "prefetch"))
        check(result.outcome == pb.OUTCOME_MISSING, f"prefetch of nothing resident: {H.describe(result)}, expected MISSING")
        check_result_form(result, "prefetch of nothing resident")


def _share(reg: Registry, kind: str) -> None:
    @reg.case(
        "outcomes", f"share-{kind}-deferred",
        f"A SHARE hint with a {kind} selector over resident blocks to a configured destination MUST get DEFERRED "
        "(REASON_UNSPECIFIED) with an operation_id that GetOperation reports.",
        requires=(f"share:{kind}", "share-destination"),
        needs=("traffic",),
    )
    def deferred(ctx: CaseContext) -> None:
        sel, _blocks, _p, _s = resident_selection(ctx, kind)
        result = ctx.apply_one(H.hint(sel, "share", destination=ctx.caps.share_destinations[0]))
        _deferred_checks(ctx, "share", result, wait=False)
        wait_operation(ctx, result.operation_id)  # let it finish before the next case

    @reg.case(
        "outcomes", f"share-{kind}-missing",
        f"A SHARE hint with a {kind} selector that resolves to nothing resident MUST get MISSING.",
        requires=(f"share:{kind}", "share-destination"),
    )
    def missing(ctx: CaseContext) -> None:
        result = ctx.apply_one(H.hint(absent_selection(ctx, kind), "share", destination=ctx.caps.share_destinations[0]))
        check(result.outcome == pb.OUTCOME_MISSING, f"share of nothing resident: {H.describe(result)}, expected MISSING")
        check_result_form(result, "share of nothing resident")
