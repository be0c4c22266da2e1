"""Read-only commands: `capabilities`, `residency`, `sessions`, `health`."""

from __future__ import annotations

import argparse
from typing import Any

from kvhint.v1 import kvhint_pb2

from ..names import action_name, enum_name, parse_tier, tier_name
from ..proto_json import message_to_dict
from ..results import Residency
from .context import EXIT_NEGATIVE, EXIT_OK, CliContext, UsageError
from .output import counts_text, retention_text, seconds_text, short_hash, table, time_text
from .selector_args import add_selector_options, target_from_args


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    caps = subparsers.add_parser("capabilities", parents=[common], help="what the engine supports (GetCapabilities)")
    caps.set_defaults(run=run_capabilities)

    residency = subparsers.add_parser(
        "residency", parents=[common], help="where a selector's blocks are (QueryResidency, all pages)"
    )
    add_selector_options(residency)
    residency.add_argument("--tier", action="append", default=[], help="only these tiers (repeatable)")
    residency.add_argument("--page-size", type=int, default=0, metavar="N", help="blocks per page (0: server default)")
    residency.set_defaults(run=run_residency)

    sessions = subparsers.add_parser("sessions", parents=[common], help="sessions the engine knows (ListSessions, all pages)")
    sessions.add_argument("--prefix", default="", help="only session ids starting with this")
    sessions.add_argument("--page-size", type=int, default=0, metavar="N", help="sessions per page (0: server default)")
    sessions.set_defaults(run=run_sessions)

    health = subparsers.add_parser(
        "health", parents=[common], help="grpc.health.v1 status; exit 1 unless SERVING",
    )
    health.set_defaults(run=run_health)


def _page_size(value: int) -> int:
    if not 0 <= value <= 2**32 - 1:
        raise UsageError(f"--page-size must be in 0..{2**32 - 1} (0: the server's default)")
    return value


def run_capabilities(args: argparse.Namespace, ctx: CliContext) -> int:
    caps = ctx.client().capabilities()
    if ctx.json:
        ctx.emit_json(message_to_dict(caps))
        return EXIT_OK
    limits = caps.limits
    lines = [
        f"protocol        {caps.protocol_version}",
        f"engine          {caps.engine} {caps.engine_version}".rstrip(),
        f"block size      {caps.block_size} tokens, {caps.num_device_blocks} device blocks",
        f"block hashes    {caps.block_hash_encoding}",
        f"epoch           {caps.epoch} (replay window {caps.event_replay_window} events)",
        f"tiers           {', '.join(f'{tier_name(t.tier)}({t.medium}' + (f', {t.capacity_blocks} blocks' if t.capacity_blocks else '') + (', shared' if t.shared else '') + (', honours retention' if t.honours_retention else '') + ')' for t in caps.tiers)}",
        f"max ttl         {seconds_text(limits.max_ttl)}",
        f"pin budget      {limits.pin_budget_blocks} blocks ({limits.pin_budget_fraction:.0%} of device)",
        f"max batch       {limits.max_hints_per_batch} hints, {limits.max_block_hashes_per_selector} hashes per selector"
        + (f", {limits.max_block_hashes_per_batch} in all" if limits.max_block_hashes_per_batch else ""),
        f"share peers     {', '.join(caps.share_destinations) or '-'}",
        "",
    ]
    rows = []
    for support in caps.actions:
        kinds = ",".join(enum_name(kvhint_pb2.SelectorKind, "SELECTOR_KIND_", k).lower() for k in support.selectors)
        rows.append((action_name(support.action).lower(), "yes" if support.supported else "no", kinds,
                     "yes" if support.supports_range else "", support.notes))
    ctx.print("\n".join(lines) + table(("ACTION", "SUPPORTED", "SELECTORS", "RANGE", "NOTES"), rows))
    return EXIT_OK


def run_residency(args: argparse.Namespace, ctx: CliContext) -> int:
    target = target_from_args(args)
    try:
        tiers = [parse_tier(t) for t in args.tier]
    except ValueError as error:
        raise UsageError(str(error)) from None
    residency = ctx.client().query_residency(target, tiers=tiers, page_size=_page_size(args.page_size))
    if ctx.json:
        ctx.emit_json(residency_json(residency))
        return EXIT_OK
    rows = [
        (b.position, b.block_hash.hex(), ",".join(tier_name(t) for t in b.tiers), "yes" if b.in_use else "",
         retention_text(b.retention), ",".join(b.session_ids))
        for b in residency.blocks
    ]
    totals = " ".join(f"{tier_name(t)}={n}" for t, n in sorted(residency.totals.items())) or "none"
    ctx.print(table(("POS", "HASH", "TIERS", "IN_USE", "RETENTION", "SESSIONS"), rows))
    ctx.print(f"{len(residency.blocks)} blocks; totals {totals}; as of {residency.as_of_epoch}:{residency.as_of_sequence}")
    return EXIT_OK


def residency_json(residency: Residency) -> dict[str, Any]:
    return {
        "blocks": [message_to_dict(b) for b in residency.blocks],
        # a tier this client does not know (a newer server's) as its number, as message_to_dict writes it
        "totals": [{"tier": kvhint_pb2.Tier.Name(t) if t in kvhint_pb2.Tier.values() else t, "blocks": n}  # type: ignore[arg-type]
                   for t, n in sorted(residency.totals.items())],
        "as_of_epoch": residency.as_of_epoch,
        "as_of_sequence": residency.as_of_sequence,
    }


def run_sessions(args: argparse.Namespace, ctx: CliContext) -> int:
    sessions = ctx.client().list_sessions(prefix=args.prefix, page_size=_page_size(args.page_size))
    if ctx.json:
        ctx.emit_json({"sessions": [message_to_dict(s) for s in sessions]})
        return EXIT_OK
    rows = [
        (s.session_id, s.parent_session_id, counts_text(s.blocks), retention_text(s.retention),
         ",".join(s.continuation_ids), ",".join(short_hash(h) for h in s.frontier_hashes), time_text(s.last_active))
        for s in sessions
    ]
    ctx.print(table(("SESSION", "PARENT", "BLOCKS", "RETENTION", "CONTINUATIONS", "FRONTIERS", "LAST_ACTIVE"), rows))
    ctx.print(f"{len(sessions)} session{'' if len(sessions) == 1 else 's'}")
    return EXIT_OK


def run_health(args: argparse.Namespace, ctx: CliContext) -> int:
    report = ctx.client().health()
    if ctx.json:
        ctx.emit_json({"serving": report.serving, "statuses": report.statuses})
    else:
        ctx.print(table(("SERVICE", "STATUS"), [(name or "(server)", status) for name, status in report.statuses.items()]))
    return EXIT_OK if report.serving else EXIT_NEGATIVE
