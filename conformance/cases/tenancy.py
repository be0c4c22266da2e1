"""Tenancy: two tenants on one engine see and change only their own sessions.

The cases need two tenants' credentials and namespaces (--tenant-a-token,
--tenant-a-prefix, --tenant-b-token, --tenant-b-prefix) and skip without them.
Sessions are named `<prefix>kvc-<nonce>-...`, so a run never touches real
sessions. Accepted answers follow the kvhint.v1 tenancy rules: a hint whose
session or continuation selector is in another tenant's namespace is
REJECTED/PERMISSION_DENIED or MISSING, with zero effect; a query or a watch
filter naming one is PERMISSION_DENIED (or, for a query, answers nothing).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import grpc

from kvhint.v1 import kvhint_pb2 as pb
from kvhint.v1 import kvhint_pb2_grpc as pbg

from .. import hints as H
from ..model import CaseFailed, CaseSkipped, Registry, check
from ..target import BearerToken, CaseContext, every_page, rpc_error_text

_DENIED = ((pb.OUTCOME_REJECTED, pb.REASON_PERMISSION_DENIED), (pb.OUTCOME_MISSING, pb.REASON_NOT_RESIDENT))


@dataclass
class Tenant:
    name: str
    prefix: str
    stub: pbg.KvHintServiceStub
    timeout: float

    def apply(self, *hints: pb.Hint) -> list[pb.HintResult]:
        try:
            return list(self.stub.ApplyHints(pb.ApplyHintsRequest(hints=list(hints)), timeout=self.timeout).results)
        except grpc.RpcError as err:
            raise CaseFailed(f"tenant {self.name}: ApplyHints failed: {rpc_error_text(err)}") from err

    def sessions(self, prefix: str = "") -> list[pb.SessionInfo]:
        return every_page(
            f"tenant {self.name}: ListSessions",
            lambda token: self.stub.ListSessions(pb.ListSessionsRequest(session_id_prefix=prefix, page_token=token),
                                                 timeout=self.timeout),
            "sessions",
        )


@contextlib.contextmanager
def tenants(ctx: CaseContext) -> Iterator[tuple[Tenant, Tenant]]:
    o = ctx.target.options
    given = (o.tenant_a_token, o.tenant_a_prefix, o.tenant_b_token, o.tenant_b_prefix)
    if not all(given):
        raise CaseSkipped("no tenants given (--tenant-a-token, --tenant-a-prefix, --tenant-b-token, --tenant-b-prefix)")
    channels = []
    out = []
    for name, token, prefix in (("A", o.tenant_a_token, o.tenant_a_prefix), ("B", o.tenant_b_token, o.tenant_b_prefix)):
        channel = grpc.intercept_channel(grpc.insecure_channel(o.target), BearerToken(token or ""))
        channels.append(channel)
        out.append(Tenant(name, prefix or "", pbg.KvHintServiceStub(channel), o.rpc_timeout))
    try:
        yield out[0], out[1]
    finally:
        for channel in channels:
            channel.close()


def _held_session(ctx: CaseContext, tenant: Tenant, name: str) -> str | None:
    """A session in `tenant`'s namespace with resident blocks: the first it lists, else one the
    suite stores through the OpenAI endpoint; None when it lists none and there is no endpoint
    (then another tenant's hints and listings have nothing of it to reach)."""
    listed = tenant.sessions(tenant.prefix)
    if listed:
        return listed[0].session_id
    if not ctx.target.need("traffic")[0]:
        return None
    session = tenant.prefix + ctx.sid(name)
    ctx.complete(ctx.small_prompt(name), session)  # the suite stands in for the gateway that sets session ids
    return session


def _status(call) -> grpc.StatusCode | None:  # type: ignore[no-untyped-def]
    try:
        call()
    except grpc.RpcError as err:
        return err.code()
    return None


def register(reg: Registry) -> None:
    @reg.case(
        "tenancy", "unknown-token-unauthenticated",
        "With tenants configured, an RPC with a token that belongs to no tenant MUST fail UNAUTHENTICATED.",
    )
    def unknown_token(ctx: CaseContext) -> None:
        with tenants(ctx):
            channel = grpc.intercept_channel(grpc.insecure_channel(ctx.target.options.target),
                                             BearerToken(f"kvc-not-a-token-{ctx.target.options.nonce}"))
            try:
                code = _status(lambda: pbg.KvHintServiceStub(channel).ListSessions(pb.ListSessionsRequest(), timeout=ctx.timeout))
            finally:
                channel.close()
            check(code == grpc.StatusCode.UNAUTHENTICATED, f"ListSessions with an unknown token: {code}, expected UNAUTHENTICATED")

    @reg.case(
        "tenancy", "cross-tenant-hints-have-no-effect",
        "A hint of tenant B whose session or continuation selector is in tenant A's namespace MUST be "
        "REJECTED/PERMISSION_DENIED or MISSING, for every action, and MUST NOT change what A sees.",
    )
    def cross_hints(ctx: CaseContext) -> None:
        with tenants(ctx) as (a, b):
            # A synthetic id, and one of A's live sessions (stored when A has none), where a wrong answer shows.
            held = _held_session(ctx, a, "held")
            victims = [a.prefix + ctx.sid("victim"), *([held] if held else [])]
            seen_before = sorted(s.SerializeToString(deterministic=True) for s in a.sessions(a.prefix))
            for victim in victims:
                hints = [H.retain(victim, ttl=30), H.pin(victim, ttl=30), H.evict(victim), H.release(victim)]
                hints.append(pb.Hint(selector=pb.Selector(continuation=pb.ContinuationSelector(
                    continuation_id=a.prefix + ctx.cid("victim"))), evict=pb.EvictAction()))
                for hint, result in zip(hints, b.apply(*hints)):
                    check((result.outcome, result.reason) in _DENIED,
                          f"tenant B's {hint.WhichOneof('action')} on A's {hint.selector.WhichOneof('target')}: "
                          f"{H.describe(result)}, expected REJECTED/PERMISSION_DENIED or MISSING")
            seen_after = sorted(s.SerializeToString(deterministic=True) for s in a.sessions(a.prefix))
            check(seen_after == seen_before, "what tenant A's ListSessions shows changed after tenant B's denied hints")
            if held is None:
                raise CaseSkipped("tenant A holds no session and no --openai-url is given to store one: B's hints "
                                  "had nothing of A's to change")

    @reg.case(
        "tenancy", "list-sessions-own-namespace",
        "ListSessions of a tenant MUST list only sessions in its own namespace, whatever prefix it asks for.",
    )
    def own_list(ctx: CaseContext) -> None:
        with tenants(ctx) as (a, b):
            # A session of each tenant's, so that the other's listing without isolation shows one.
            held = [_held_session(ctx, t, f"listed-{t.name.lower()}") for t in (a, b)]
            for me, other in ((a, b), (b, a)):
                for prefix in ("", other.prefix):
                    foreign = [s.session_id for s in me.sessions(prefix) if not s.session_id.startswith(me.prefix)]
                    check(not foreign, f"tenant {me.name} listed {len(foreign)} sessions outside its namespace "
                                       f"(prefix {prefix!r}), e.g. {foreign[:1]}")
            if not any(held):
                raise CaseSkipped("neither tenant holds a session and no --openai-url is given to store one: no "
                                  "listing could show another tenant's session")

    @reg.case(
        "tenancy", "foreign-query-and-watch-denied",
        "QueryResidency of a session in another tenant's namespace MUST fail PERMISSION_DENIED or select "
        "nothing, and WatchEvents with a filter naming one MUST fail PERMISSION_DENIED.",
    )
    def foreign_query(ctx: CaseContext) -> None:
        with tenants(ctx) as (a, b):
            victim = a.prefix + ctx.sid("victim")
            try:
                r = b.stub.QueryResidency(pb.QueryResidencyRequest(selector=H.session_selector(victim)), timeout=ctx.timeout)
                check(not r.blocks, f"tenant B's QueryResidency of A's session returned {len(r.blocks)} blocks")
            except grpc.RpcError as err:
                check(err.code() == grpc.StatusCode.PERMISSION_DENIED,
                      f"tenant B's QueryResidency of A's session: {err.code().name}, expected PERMISSION_DENIED")
            call = b.stub.WatchEvents(pb.WatchEventsRequest(filter=pb.EventFilter(session_ids=[victim])), timeout=ctx.timeout)
            code = _status(lambda: next(iter(call)))
            call.cancel()
            check(code == grpc.StatusCode.PERMISSION_DENIED,
                  f"tenant B's WatchEvents filtered on A's session: {code}, expected PERMISSION_DENIED")

    @reg.case(
        "tenancy", "shared-prefix-not-evicted-by-other-tenant",
        "When tenants A and B cached the same prompt, B's Evict of its session MUST NOT evict the blocks A's "
        "session holds (CLIPPED/PERMISSION_DENIED): A's session MUST keep every device block.",
        requires=("evict:session",),
        needs=("traffic",),
    )
    def shared(ctx: CaseContext) -> None:
        with tenants(ctx) as (a, b):
            prompt = ctx.small_prompt("shared")
            sa, sb = a.prefix + ctx.sid("a"), b.prefix + ctx.sid("b")
            ctx.complete(prompt, sa)  # the suite stands in for the gateway that sets session ids
            ctx.complete(prompt, sb)
            try:
                mine = a.stub.QueryResidency(pb.QueryResidencyRequest(selector=H.session_selector(sa)), timeout=ctx.timeout)
            except grpc.RpcError as err:
                raise CaseFailed(f"tenant A's QueryResidency failed: {rpc_error_text(err)}") from err
            before = [x.block_hash for x in mine.blocks if pb.TIER_DEVICE in x.tiers]
            check(before, "tenant A's session holds no device blocks after its request")
            (result,) = b.apply(H.evict(sb))
            check(result.outcome == pb.OUTCOME_CLIPPED and any(c.reason == pb.REASON_PERMISSION_DENIED for c in result.clips),
                  f"tenant B's evict of a prefix shared with A: {H.describe(result)}, expected CLIPPED/PERMISSION_DENIED")
            after = a.stub.QueryResidency(pb.QueryResidencyRequest(selector=H.session_selector(sa)), timeout=ctx.timeout)
            still = {x.block_hash for x in after.blocks if pb.TIER_DEVICE in x.tiers}
            lost = [x for x in before if x not in still]
            check(not lost, f"tenant B's evict removed {len(lost)} of tenant A's {len(before)} device blocks")
            a.apply(H.release(sa))
            b.apply(H.release(sb))
