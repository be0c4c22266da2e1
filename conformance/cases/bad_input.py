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

APPLY = "/kvhint.v1.KvHintService/ApplyHints"
DOMAIN = "kvhint.v1"


def expect_invalid_argument(call: Callable[[], object], what: str, reason: str | None = None) -> KvHintError:
    """Run `call`; it must fail INVALID_ARGUMENT with an ErrorInfo in domain kvhint.v1 whose reason is a
    kvhint.v1 Reason name (`reason` when given)."""
    try:
        call()
    except grpc.RpcError as err:
        e = KvHintError.from_rpc_error(err)
        check(e.code == grpc.StatusCode.INVALID_ARGUMENT, f"{what}: failed with {e.code.name}, expected INVALID_ARGUMENT")
        check(e.reason is not None, f"{what}: INVALID_ARGUMENT without a google.rpc.ErrorInfo detail")
        check(e.domain == DOMAIN, f"{what}: ErrorInfo.domain={e.domain!r}, expected {DOMAIN!r}")
        check(e.reason in pb.Reason.keys(), f"{what}: ErrorInfo.reason={e.reason!r} is not a kvhint.v1 Reason name")
        if reason is not None:
            check(e.reason == reason, f"{what}: ErrorInfo.reason={e.reason}, expected {reason}")
        return e
    raise CaseFailed(f"{what}: the RPC succeeded, expected INVALID_ARGUMENT")


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
        "bad-input", "invalid-hints-rejected-per-hint",
        "A hint that is invalid on its own (no action, no selector, missing or non-positive TTL, empty or over-long "
        "ids, a bad range, an empty or over-long block hash) MUST get REJECTED with REASON_INVALID_HINT and a message, "
        "without failing the RPC or the other hints of the batch.",
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
        for label, hint, result in zip(labels, batch, results):
            if label == "valid":
                check(result.outcome == pb.OUTCOME_MISSING, f"the valid hint amid invalid ones: {H.describe(result)}, expected MISSING")
                check(result.hint_id == hint.hint_id, "the valid hint's id was not echoed")
                continue
            check(
                result.outcome == pb.OUTCOME_REJECTED and result.reason == pb.REASON_INVALID_HINT,
                f"{label}: {H.describe(result)}, expected REJECTED/INVALID_HINT",
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
        for i in range(200):
            raw = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
            try:
                call(raw, timeout=ctx.timeout)
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.INVALID_ARGUMENT:
                    failures += 1
                    if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                        raise CaseFailed(f"random request bytes #{i} made the target {err.code().name}") from err
        check(failures == 0, f"{failures} of 200 random ApplyHints payloads failed with a code other than INVALID_ARGUMENT")
        result = ctx.apply_one(H.release(ctx.sid("after")))
        check(result.outcome == pb.OUTCOME_MISSING, f"a release after bad input: {H.describe(result)}")
        prompt = ctx.small_prompt("after")
        first = ctx.complete(prompt, ctx.sid("after"))
        second = ctx.complete(prompt, ctx.sid("after"))
        check(first.prompt_tokens == len(prompt), f"usage.prompt_tokens={first.prompt_tokens} for {len(prompt)} tokens")
        check(second.cached_tokens == 3 * ctx.plan.block_size, f"a repeated prompt after bad input hit {second.cached_tokens} tokens")
