"""Capability negotiation: what GetCapabilities must say, and that it is honoured."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvhint.v1 import kvhint_pb2 as pb

from .. import hints as H
from .. import profiles
from ..model import CaseFailed, CaseSkipped, Registry, check
from ..target import CaseContext, rpc_error_text

SERVICE = "kvhint.v1.KvHintService"


def _a(action: str) -> str:
    return "An" if action[0] in "aeiou" else "A"


def register(reg: Registry) -> None:
    @reg.case(
        "capabilities", "protocol-version",
        "GetCapabilities MUST report protocol_version \"kvhint.v1\", a non-empty engine name and a non-empty epoch.",
    )
    def protocol_version(ctx: CaseContext) -> None:
        caps = ctx.target.refresh_caps()
        check(caps.protocol_version == "kvhint.v1", f"protocol_version={caps.protocol_version!r}, expected 'kvhint.v1'")
        check(caps.engine, "engine is empty")
        check(caps.epoch, "epoch is empty")

    @reg.case(
        "capabilities", "one-entry-per-action",
        "GetCapabilities MUST report exactly one ActionSupport per Action, and every supported action MUST name at "
        "least one selector kind.",
    )
    def one_entry_per_action(ctx: CaseContext) -> None:
        seen: dict[int, int] = {}
        for support in ctx.caps.actions:
            seen[support.action] = seen.get(support.action, 0) + 1
            if support.supported:
                check(support.selectors, f"{H.ACTION_NAME.get(support.action, support.action)} is supported but names no selector kind")
            check(support.action in H.ACTION_NAME, f"ActionSupport for {support.action} (not a kvhint.v1 Action)")
        missing = [pb.Action.Name(a) for a in H.ACTION_ENUM.values() if a not in seen]
        duplicated = [H.ACTION_NAME[a] for a, n in seen.items() if n > 1 and a in H.ACTION_NAME]  # type: ignore[index]
        check(not missing, f"no ActionSupport entry for {', '.join(missing)}")
        check(not duplicated, f"several ActionSupport entries for {', '.join(duplicated)}")

    @reg.case(
        "capabilities", "limits-are-consistent",
        "GetCapabilities MUST report a positive block_size and num_device_blocks, the device tier first, a positive "
        "max_ttl, max_hints_per_batch and event_replay_window, and a pin budget within the device pool that matches "
        "pin_budget_fraction.",
    )
    def limits(ctx: CaseContext) -> None:
        caps = ctx.caps
        lim = caps.limits
        check(caps.block_size > 0, f"block_size={caps.block_size}")
        check(caps.num_device_blocks > 0, f"num_device_blocks={caps.num_device_blocks}")
        check(caps.tiers and caps.tiers[0].tier == pb.TIER_DEVICE, f"tiers={[pb.Tier.Name(t.tier) for t in caps.tiers]}: device first")
        check(lim.max_ttl.seconds > 0 or lim.max_ttl.nanos > 0, "limits.max_ttl is not positive")
        check(lim.max_hints_per_batch > 0, "limits.max_hints_per_batch is 0")
        check(caps.event_replay_window > 0, "event_replay_window is 0")
        check(0.0 <= lim.pin_budget_fraction <= 1.0, f"pin_budget_fraction={lim.pin_budget_fraction}")
        check(
            lim.pin_budget_blocks <= caps.num_device_blocks,
            f"pin_budget_blocks={lim.pin_budget_blocks} exceeds num_device_blocks={caps.num_device_blocks}",
        )
        expected = lim.pin_budget_fraction * caps.num_device_blocks
        check(
            abs(lim.pin_budget_blocks - expected) <= max(2.0, 0.02 * caps.num_device_blocks),
            f"pin_budget_blocks={lim.pin_budget_blocks} does not match pin_budget_fraction={lim.pin_budget_fraction} "
            f"of {caps.num_device_blocks} blocks",
        )

    @reg.case(
        "capabilities", "health-serving",
        "The server MUST serve grpc.health.v1 beside kvhint.v1 and report SERVING for \"kvhint.v1.KvHintService\".",
    )
    def health(ctx: CaseContext) -> None:
        stub = health_pb2_grpc.HealthStub(ctx.target.channel)
        try:
            status = stub.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=ctx.timeout).status
        except grpc.RpcError as err:
            raise CaseFailed(f"grpc.health.v1 Check failed: {rpc_error_text(err)}") from err
        check(status == health_pb2.HealthCheckResponse.SERVING, f"health status {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}")

    @reg.case(
        "capabilities", "reflection-lists-service",
        "The server MUST serve gRPC server reflection, and it MUST list kvhint.v1.KvHintService.",
    )
    def reflection(ctx: CaseContext) -> None:
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        stub = reflection_pb2_grpc.ServerReflectionStub(ctx.target.channel)
        try:
            responses = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=ctx.timeout))
        except grpc.RpcError as err:
            raise CaseFailed(f"ServerReflectionInfo failed: {rpc_error_text(err)}") from err
        names = [s.name for r in responses for s in r.list_services_response.service]
        check(SERVICE in names, f"reflection lists {names}")

    for name in profiles.PROFILES:
        _profile_case(reg, name)
    for action in H.ACTIONS:
        _unadvertised_case(reg, action)


def _profile_case(reg: Registry, name: str) -> None:
    profile = profiles.PROFILES[name]
    needed = sorted(profiles.required(name))

    @reg.case(
        "capabilities", f"profile-{name}",
        f"A target claiming the '{name}' profile ({profile.summary}) MUST advertise every one of its capabilities in "
        f"GetCapabilities: {', '.join(needed)}.",
    )
    def profile_case(ctx: CaseContext) -> None:
        claimed = ctx.target.options.profile
        if name not in profiles.included(claimed):
            raise CaseSkipped(f"the run claims the '{claimed}' profile (--profile), which does not include '{name}'")
        have = ctx.target.capabilities
        missing = [c for c in needed if c not in have]
        check(not missing, f"the '{name}' profile requires {', '.join(missing)}, which the target does not advertise")


def _unadvertised_case(reg: Registry, action: str) -> None:
    @reg.case(
        "capabilities", f"{action}-unadvertised-selectors-unsupported",
        f"{_a(action)} {action.upper()} hint with a selector kind the target does not advertise for {action.upper()} (or any "
        f"{action.upper()} hint when the action is unsupported) MUST get REJECTED with REASON_UNSUPPORTED, "
        "never a failed RPC.",
    )
    def unadvertised(ctx: CaseContext) -> None:
        have = ctx.target.capabilities
        unadvertised = [s for s in H.SELECTORS if f"{action}:{s}" not in have]
        if not unadvertised:
            raise CaseSkipped(f"{action} is advertised with every selector kind; nothing unadvertised to check")
        selectors = {
            "session": H.session_selector(ctx.sid("any")),
            "continuation": H.continuation_selector(ctx.cid("any")),
            "block-hashes": H.hashes_selector([bytes(range(1, 33))]),
        }
        destination = (list(ctx.caps.share_destinations) or ["unconfigured-peer:1"])[0]
        batch = [H.hint(selectors[s], action, ttl=5, destination=destination) for s in unadvertised]
        results = ctx.apply(*batch)
        for kind, result in zip(unadvertised, results):
            check(
                result.outcome == pb.OUTCOME_REJECTED and result.reason == pb.REASON_UNSUPPORTED,
                f"{action} with an unadvertised {kind} selector: {H.describe(result)}, expected REJECTED/UNSUPPORTED",
            )
