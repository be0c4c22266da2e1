"""Bad input: INVALID_ARGUMENT with a google.rpc.ErrorInfo for malformed requests, per-hint
REJECTED for bad hints, and an engine that keeps serving afterwards."""

from __future__ import annotations

import random
from collections.abc import Callable

import grpc
from google.protobuf import duration_pb2

from kvhint.v1 import kvhint_pb2 as pb
from kvhint_client.errors import KvHintError

from .. import hints as H
from ..model import CaseFailed, CaseSkipped, Registry, check
from ..target import CaseContext
from ..watch import kind

APPLY = "/kvhint.v1.KvHintService/ApplyHints"
DOMAIN = "kvhint.v1"


def expect_invalid_argument(call: Callable[[], object], what: str, reason: str | None = None) -> KvHintError:
    """Run `call`; it must fail INVALID_ARGUMENT with an ErrorInfo in domain kvhint.v1 whose reason is a
    kvhint.v1 Reason name (`reason` when given)."""
    try:
        call()
    except grpc.RpcError as err:
        return check_invalid_argument(err, what, reason)
    raise CaseFailed(f"{what}: the RPC succeeded, expected INVALID_ARGUMENT")


def check_invalid_argument(err: grpc.RpcError, what: str, reason: str | None = None) -> KvHintError:
    """`err` is INVALID_ARGUMENT with an ErrorInfo in domain kvhint.v1 whose reason is a kvhint.v1
    Reason name (`reason` when given)."""
    e = KvHintError.from_rpc_error(err)
    check(e.code == grpc.StatusCode.INVALID_ARGUMENT, f"{what}: failed with {e.code.name}, expected INVALID_ARGUMENT")
    check(e.reason is not None, f"{what}: INVALID_ARGUMENT without a google.rpc.ErrorInfo detail")
    check(e.domain == DOMAIN, f"{what}: ErrorInfo.domain={e.domain!r}, expected {DOMAIN!r}")
    check(e.reason in pb.Reason.keys(), f"{what}: ErrorInfo.reason={e.reason!r} is not a kvhint.v1 Reason name")
    if reason is not None:
        check(e.reason == reason, f"{what}: ErrorInfo.reason={e.reason}, expected {reason}")
    return e


def unadvertised_features(hint: pb.Hint, have: set[str]) -> list[str]:
    """The capabilities (conformance.target vocabulary) that `hint` uses and the target does not
    advertise: its action, the action with its selector kind, the action with a range. Such a hint
    may be REJECTED/UNSUPPORTED (the proto: what is not advertised is UNSUPPORTED) even when its
    form is also invalid; the order of those two checks is the engine's."""
    action = hint.WhichOneof("action")
    if action is None:
        return []
    if action not in have:
        return [action]
    out: list[str] = []
    if hint.HasField("selector"):
        target = hint.selector.WhichOneof("target")
        kind = {"session": "session", "continuation": "continuation", "block_hashes": "block-hashes"}.get(target or "")
        if kind is not None and f"{action}:{kind}" not in have:
            out.append(f"{action}:{kind}")
        if hint.selector.HasField("range") and f"{action}:range" not in have:
            out.append(f"{action}:range")
    return out


def none_applied(ctx: CaseContext, hint_id: str) -> None:
    """Nothing of a batch refused as a whole was applied: its first hint's id was never seen, so
    re-using it for another hint is no conflict and no replay."""
    result = ctx.apply_one(H.release(ctx.sid("other"), hint_id=hint_id))
    check(
        result.reason != pb.REASON_HINT_ID_CONFLICT and not result.replayed,
        f"a hint id of the rejected batch is known to the target ({H.describe(result)}): part of it was applied",
    )


def register(reg: Registry) -> None:
    @reg.case(
        "bad-input", "empty-batch-invalid-argument",
        "An ApplyHints request without hints MUST fail with INVALID_ARGUMENT and a google.rpc.ErrorInfo "
        "(domain \"kvhint.v1\", a kvhint.v1 Reason name as reason).",
    )
    def empty(ctx: CaseContext) -> None:
        expect_invalid_argument(lambda: ctx.stub.ApplyHints(pb.ApplyHintsRequest(), timeout=ctx.timeout), "an empty batch")

    @reg.case(
        "bad-input", "too-many-hints-invalid-argument",
        "An ApplyHints batch larger than limits.max_hints_per_batch MUST fail with INVALID_ARGUMENT and an ErrorInfo "
        "with reason REASON_TOO_MANY_HINTS, and MUST apply none of its hints.",
    )
    def too_many(ctx: CaseContext) -> None:
        limit = ctx.caps.limits.max_hints_per_batch
        batch = [H.release(ctx.sid(f"h{i}"), hint_id=f"{ctx.sid('too-many')}-{i}") for i in range(limit + 1)]
        expect_invalid_argument(
            lambda: ctx.stub.ApplyHints(pb.ApplyHintsRequest(hints=batch), timeout=ctx.timeout),
            f"a batch of {limit + 1} hints (limit {limit})",
            "REASON_TOO_MANY_HINTS",
        )
        none_applied(ctx, batch[0].hint_id)

    @reg.case(
        "bad-input", "too-many-block-hashes-invalid-argument",
        "An ApplyHints batch whose block_hashes selectors hold more than limits.max_block_hashes_per_batch hashes "
        "in all (each selector within max_block_hashes_per_selector) MUST fail with INVALID_ARGUMENT and an "
        "ErrorInfo with reason REASON_TOO_MANY_HINTS, and MUST apply none of its hints.",
        requires=("release:block-hashes",),
    )
    def too_many_hashes(ctx: CaseContext) -> None:
        limits = ctx.caps.limits
        limit, per_selector = limits.max_block_hashes_per_batch, limits.max_block_hashes_per_selector or (1 << 31)
        if not limit:
            raise CaseSkipped("the target advertises no limits.max_block_hashes_per_batch")
        hints_needed = -(-(limit + 1) // per_selector)
        if hints_needed > limits.max_hints_per_batch:
            raise CaseSkipped(f"{limit + 1} hashes need {hints_needed} selectors, over max_hints_per_batch")
        width = 8 if ctx.caps.block_hash_encoding == "int64" else 32
        if (limit + 1) * (width + 2) > 3 << 20:
            raise CaseSkipped(f"{limit + 1} hashes of {width} bytes make a request near gRPC's default 4 MiB message limit")
        hashes = [i.to_bytes(width, "big") for i in range(1, limit + 2)]
        batch = [pb.Hint(hint_id=f"{ctx.sid('too-many-hashes')}-{j}", selector=H.hashes_selector(hashes[k : k + per_selector]),
                         release=pb.ReleaseAction()) for j, k in enumerate(range(0, len(hashes), per_selector))]
        expect_invalid_argument(
            lambda: ctx.stub.ApplyHints(pb.ApplyHintsRequest(hints=batch), timeout=ctx.timeout),
            f"a batch of {len(batch)} hints with {limit + 1} block hashes in all (limit {limit})",
            "REASON_TOO_MANY_HINTS",
        )
        none_applied(ctx, batch[0].hint_id)

    @reg.case(
        "bad-input", "undecodable-request-invalid-argument",
        "An ApplyHints request whose bytes are not a valid ApplyHintsRequest MUST fail with INVALID_ARGUMENT and an "
        "ErrorInfo.",
    )
    def undecodable(ctx: CaseContext) -> None:
        call = ctx.target.channel.unary_unary(APPLY, request_serializer=None, response_deserializer=pb.ApplyHintsResponse.FromString)
        for raw in (b"\x0a\xff\xff\xff\xff\x0f", b"\xff\xff\xff", b"\x0a\x05\x0a\x03\x0a"):
            expect_invalid_argument(lambda: call(raw, timeout=ctx.timeout), f"undecodable bytes {raw.hex()}")

    @reg.case(
        "bad-input", "query-without-selector-invalid-argument",
        "A QueryResidency request without a selector target MUST fail with INVALID_ARGUMENT and an ErrorInfo.",
    )
    def query_without_selector(ctx: CaseContext) -> None:
        expect_invalid_argument(lambda: ctx.stub.QueryResidency(pb.QueryResidencyRequest(), timeout=ctx.timeout), "QueryResidency without a selector")
        expect_invalid_argument(
            lambda: ctx.stub.QueryResidency(pb.QueryResidencyRequest(selector=pb.Selector()), timeout=ctx.timeout),
            "QueryResidency with an empty selector",
        )

    @reg.case(
        "bad-input", "unknown-operation-not-found",
        "GetOperation for an unknown operation id MUST fail with NOT_FOUND and an ErrorInfo with reason REASON_NOT_FOUND.",
    )
    def unknown_operation(ctx: CaseContext) -> None:
        try:
            ctx.stub.GetOperation(pb.GetOperationRequest(operation_id=ctx.sid("no-such-op")), timeout=ctx.timeout)
        except grpc.RpcError as err:
            e = KvHintError.from_rpc_error(err)
            check(e.code == grpc.StatusCode.NOT_FOUND, f"unknown operation: {e.code.name}, expected NOT_FOUND")
            check(e.reason == "REASON_NOT_FOUND", f"unknown operation: ErrorInfo.reason={e.reason!r}, expected REASON_NOT_FOUND")
            return
        raise CaseFailed("GetOperation of an unknown id succeeded")

    @reg.case(
        "bad-input", "malformed-operation-id-invalid-argument",
        "GetOperation with an empty operation_id, or one longer than limits.max_id_length, MUST fail with "
        "INVALID_ARGUMENT and an ErrorInfo (not NOT_FOUND: the id is malformed, not unknown).",
    )
    def malformed_operation_id(ctx: CaseContext) -> None:
        limit = ctx.caps.limits.max_id_length or 256
        for what, operation_id in (("an empty operation_id", ""),
                                   (f"an operation_id of {limit + 1} bytes (limits.max_id_length {limit})", "o" * (limit + 1))):
            expect_invalid_argument(
                lambda operation_id=operation_id: ctx.stub.GetOperation(pb.GetOperationRequest(operation_id=operation_id),
                                                                        timeout=ctx.timeout),
                f"GetOperation with {what}",
            )

    @reg.case(
        "bad-input", "resume-without-epoch-invalid-argument",
        "WatchEvents with START_RESUME and an empty resume_epoch, or one longer than limits.max_id_length, MUST fail "
        "with INVALID_ARGUMENT and an ErrorInfo (not answer a Resync: resume_epoch is required).",
    )
    def resume_without_epoch(ctx: CaseContext) -> None:
        limit = ctx.caps.limits.max_id_length or 256
        for label, epoch in (("an empty resume_epoch", ""),
                             (f"a resume_epoch of {limit + 1} bytes (limits.max_id_length {limit})", "e" * (limit + 1))):
            what = f"WatchEvents START_RESUME with {label}"
            watch = ctx.watch(pb.WatchEventsRequest(start=pb.WatchEventsRequest.START_RESUME, resume_epoch=epoch,
                                                    resume_after_sequence=1))
            if not watch.wait_ended(10):
                got = [kind(m) for m in watch.stop()[:5]]
                raise CaseFailed(f"{what}: the stream did not end within 10s (got {got}), expected INVALID_ARGUMENT")
            if watch.error is None:
                raise CaseFailed(f"{what}: the stream ended without an error after {[kind(m) for m in watch.messages[:5]]}, "
                                 "expected INVALID_ARGUMENT")
            check_invalid_argument(watch.error, what)

    @reg.case(
        "bad-input", "invalid-hints-rejected-per-hint",
        "A hint that is invalid on its own (no action, no selector, missing or non-positive TTL, empty or over-long "
        "ids, a bad range, an empty or over-long block hash) MUST get REJECTED with REASON_INVALID_HINT and a message, "
        "without failing the RPC or the other hints of the batch; one whose action, selector kind or range the target "
        "does not advertise MAY get REJECTED with REASON_UNSUPPORTED instead.",
        requires=("release:session",),
    )
    def per_hint(ctx: CaseContext) -> None:
        lim = ctx.caps.limits
        long_id = "x" * ((lim.max_id_length or 256) + 1)
        long_hint_id = "h" * ((lim.max_hint_id_length or 128) + 1)
        sid = ctx.sid("target")
        bad: list[tuple[str, pb.Hint]] = [
            ("no action", pb.Hint(selector=H.session_selector(sid))),
            ("no selector", pb.Hint(release=pb.ReleaseAction())),
            ("selector without target", pb.Hint(selector=pb.Selector(), release=pb.ReleaseAction())),
            ("pin without ttl", pb.Hint(selector=H.session_selector(sid), pin=pb.PinAction())),
            ("pin with a negative ttl", pb.Hint(selector=H.session_selector(sid), pin=pb.PinAction(ttl=duration_pb2.Duration(seconds=-5)))),
            ("retain with a zero ttl", pb.Hint(selector=H.session_selector(sid), retain=pb.RetainAction(ttl=duration_pb2.Duration(seconds=0)))),
            ("empty session id", H.release("")),
            ("over-long session id", H.release(long_id)),
            ("over-long hint id", H.release(sid, hint_id=long_hint_id)),
            ("empty continuation id", H.hint(H.continuation_selector(""), "release")),
            ("range end <= start", H.hint(H.session_selector(sid, range=H.block_range(3, 3)), "release")),
            ("empty block hash list", H.hint(pb.Selector(block_hashes=pb.BlockHashSelector()), "release")),
            ("empty block hash", H.hint(H.hashes_selector([b""]), "release")),
            ("65-byte block hash", H.hint(H.hashes_selector([b"\x01" * 65]), "release")),
            ("range on a block_hashes selector", pb.Hint(
                selector=pb.Selector(block_hashes=pb.BlockHashSelector(block_hashes=[b"\x01" * 8]), range=H.block_range(0, 1)),
                release=pb.ReleaseAction())),
        ]
        rng = random.Random(ctx.target.options.nonce)
        rng.shuffle(bad)
        good = H.release(ctx.sid("valid"), hint_id=ctx.sid("valid"))
        batch = [h for _, h in bad[: len(bad) // 2]] + [good] + [h for _, h in bad[len(bad) // 2 :]]
        labels = [w for w, _ in bad[: len(bad) // 2]] + ["valid"] + [w for w, _ in bad[len(bad) // 2 :]]
        results = ctx.apply(*batch)
        have = ctx.target.capabilities
        for label, hint, result in zip(labels, batch, results):
            if label == "valid":
                check(result.outcome == pb.OUTCOME_MISSING, f"the valid hint amid invalid ones: {H.describe(result)}, expected MISSING")
                check(result.hint_id == hint.hint_id, "the valid hint's id was not echoed")
                continue
            unadvertised = unadvertised_features(hint, have)
            reasons = (pb.REASON_INVALID_HINT, pb.REASON_UNSUPPORTED) if unadvertised else (pb.REASON_INVALID_HINT,)
            check(
                result.outcome == pb.OUTCOME_REJECTED and result.reason in reasons,
                f"{label}: {H.describe(result)}, expected REJECTED/INVALID_HINT"
                + (f" or REJECTED/UNSUPPORTED (the target does not advertise {', '.join(unadvertised)})" if unadvertised else ""),
            )
            check(result.message, f"{label}: REJECTED without a message")

    @reg.case(
        "bad-input", "engine-serves-after-bad-input",
        "After malformed RPCs and invalid hints the target MUST keep serving: hints still apply, and requests still "
        "complete and hit the prefix cache.",
        requires=("release:session",),
        needs=("cached-tokens",),
    )
    def still_serving(ctx: CaseContext) -> None:
        call = ctx.target.channel.unary_unary(APPLY, request_serializer=None, response_deserializer=pb.ApplyHintsResponse.FromString)
        rng = random.Random(f"{ctx.target.options.nonce}/fuzz")
        failures = 0
        codes: dict[str, int] = {}
        for i in range(200):
            raw = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
            try:
                call(raw, timeout=ctx.timeout)
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.INVALID_ARGUMENT:
                    failures += 1
                    codes[err.code().name] = codes.get(err.code().name, 0) + 1
                    if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                        raise CaseFailed(f"random request bytes #{i} made the target {err.code().name}") from err
        shown = ", ".join(f"{code} ({n})" for code, n in sorted(codes.items(), key=lambda kv: -kv[1]))
        check(failures == 0, f"{failures} of 200 random ApplyHints payloads failed with {shown}, expected INVALID_ARGUMENT")
        result = ctx.apply_one(H.release(ctx.sid("after")))
        check(result.outcome == pb.OUTCOME_MISSING, f"a release after bad input: {H.describe(result)}")
        prompt = ctx.small_prompt("after")
        first = ctx.complete(prompt, ctx.sid("after"))
        second = ctx.complete(prompt, ctx.sid("after"))
        check(first.prompt_tokens == len(prompt), f"usage.prompt_tokens={first.prompt_tokens} for {len(prompt)} tokens")
        check(second.cached_tokens == 3 * ctx.plan.block_size, f"a repeated prompt after bad input hit {second.cached_tokens} tokens")
