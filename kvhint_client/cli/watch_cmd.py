"""`kvhint watch`: print the WatchEvents stream live.

--json prints one JSON object per message (every message, heartbeats included). Human output
prints one line per message and hides heartbeats unless --show-heartbeats. Stops on Ctrl-C
(exit 0), after --count printed messages or --duration seconds (exit 0), or when the server
sends Resync (exit 1: the consumer must take a fresh snapshot).
"""

from __future__ import annotations

import argparse
import math
import threading
from typing import Any

from kvhint.v1 import kvhint_pb2

from ..builders import event_filter
from ..names import action_name, enum_name, event_kind_name, operation_state_name, outcome_name, reason_name, tier_name
from ..proto_json import message_to_dict
from .context import EXIT_NEGATIVE, EXIT_OK, CliContext, UsageError
from .output import hashes_text, time_text


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser("watch", parents=[common], help="stream residency and hint events (WatchEvents)")
    parser.add_argument("--session", action="append", default=[], metavar="ID", help="only events of this session (repeatable)")
    parser.add_argument("--tier", action="append", default=[], help="only block events on this tier (repeatable)")
    parser.add_argument(
        "--kind", action="append", default=[],
        help="only these event kinds (repeatable): " + ", ".join(
            event_kind_name(v).lower() for v in kvhint_pb2.EventKind.values() if v),
    )
    start = parser.add_mutually_exclusive_group()
    start.add_argument("--from-snapshot", action="store_true", help="start with a snapshot of current residency")
    start.add_argument("--resume", metavar="EPOCH:SEQ", help="resume after this position (epoch, last sequence seen)")
    parser.add_argument("--heartbeat", type=float, metavar="SECONDS", help="heartbeat period (server default 1s)")
    parser.add_argument("--count", type=int, metavar="N", help="exit after printing N messages")
    parser.add_argument("--duration", type=float, metavar="SECONDS", help="exit after this long")
    parser.add_argument("--show-heartbeats", action="store_true", help="human output: print heartbeats too")
    parser.set_defaults(run=run)


def _resume(text: str) -> tuple[str, int]:
    epoch, sep, seq = text.rpartition(":")
    if not sep or not epoch:
        raise UsageError(f"--resume must look like EPOCH:SEQ, got {text!r}")
    try:
        sequence = int(seq)
    except ValueError:
        raise UsageError(f"--resume sequence must be an integer, got {seq!r}") from None
    if not 0 <= sequence <= 2**64 - 1:
        raise UsageError(f"--resume sequence must be in 0..{2**64 - 1}, got {seq!r}")
    return epoch, sequence


def run(args: argparse.Namespace, ctx: CliContext) -> int:
    if args.count is not None and args.count <= 0:
        raise UsageError("--count must be > 0")
    if args.duration is not None and not (math.isfinite(args.duration) and args.duration > 0):
        raise UsageError(f"--duration must be a finite number of seconds > 0, got {args.duration!r}")
    try:
        filt = event_filter(sessions=args.session, tiers=args.tier, kinds=args.kind)
    except ValueError as error:
        raise UsageError(str(error)) from None
    resume = _resume(args.resume) if args.resume else None
    start = "snapshot" if args.from_snapshot else ("resume" if resume else "now")
    try:
        stream = ctx.client().watch(start, resume=resume, filter=filt, heartbeat=args.heartbeat)
    except ValueError as error:
        raise UsageError(str(error)) from None
    timer = None
    if args.duration is not None:
        timer = threading.Timer(args.duration, stream.cancel)
        timer.daemon = True
        timer.start()
    printed = 0
    try:
        for message in stream:
            kind = message.WhichOneof("payload")
            if ctx.json:
                ctx.emit_json_line(message_to_dict(message))
                printed += 1
            elif kind != "heartbeat" or args.show_heartbeats:
                ctx.print(event_line(message))
                printed += 1
            if kind == "resync":
                return EXIT_NEGATIVE
            if args.count is not None and printed >= args.count:
                break
    except KeyboardInterrupt:
        pass
    finally:
        stream.cancel()
        if timer is not None:
            timer.cancel()
    return EXIT_OK


def _join(*parts: str) -> str:
    return " ".join(p for p in parts if p)


def _coords(c: kvhint_pb2.SessionCoordinates) -> str:
    parts = []
    if c.session_id:
        parts.append(f"session={c.session_id}")
    if c.continuation_id:
        parts.append(f"continuation={c.continuation_id}")
    others = [s for s in c.member_session_ids if s != c.session_id]
    if others:
        parts.append(f"members={','.join(others)}")
    return " ".join(parts)


def event_line(message: kvhint_pb2.WatchEventsResponse) -> str:
    """One human line: `EPOCH:SEQ TIME KIND details`."""
    kind = message.WhichOneof("payload") or "unknown"
    head = f"{message.epoch}:{message.sequence} {time_text(message.time) or '-'} {kind.upper()}"
    detail = ""
    if kind == "blocks_stored":
        e = message.blocks_stored
        detail = _join(f"tier={tier_name(e.tier)} n={len(e.block_hashes)} pos={e.first_position}",
                       "hit" if e.prefix_hit else "", _coords(e.coordinates), f"[{hashes_text(e.block_hashes)}]")
    elif kind == "blocks_removed":
        r = message.blocks_removed
        cause = enum_name(kvhint_pb2.RemovalCause, "REMOVAL_CAUSE_", r.cause).lower()
        detail = _join(f"tier={tier_name(r.tier)} n={len(r.block_hashes)} cause={cause}",
                       "last_copy" if r.last_copy else "", _coords(r.coordinates), f"[{hashes_text(r.block_hashes)}]")
    elif kind == "tier_transfer_completed":
        t = message.tier_transfer_completed
        detail = _join(f"{tier_name(t.from_tier)}->{tier_name(t.to_tier)} n={len(t.block_hashes)} bytes={t.bytes_moved}",
                       f"op={t.operation_id}" if t.operation_id else "", _coords(t.coordinates))
    elif kind == "pin_broken":
        p = message.pin_broken
        detail = f"n={len(p.block_hashes)} sessions={','.join(p.session_ids)} shortfall={p.shortfall_blocks}"
    elif kind == "hint_applied":
        h = message.hint_applied
        action = h.hint.WhichOneof("action") or "?"
        detail = _join(f"hint={h.result.hint_id or '-'} {action} -> {outcome_name(h.result.outcome)}",
                       reason_name(h.result.reason))
    elif kind == "operation_completed":
        op = message.operation_completed.operation
        detail = _join(f"op={op.operation_id} {action_name(op.action).lower()} {operation_state_name(op.state)}",
                       reason_name(op.reason))
    elif kind == "membership_changed":
        m = message.membership_changed
        cause = enum_name(kvhint_pb2.MembershipChanged.Cause, "CAUSE_", m.cause).lower()
        detail = f"session={m.session_id} n={len(m.block_hashes)} cause={cause} [{hashes_text(m.block_hashes)}]"
    elif kind == "all_blocks_cleared":
        detail = f"tier={tier_name(message.all_blocks_cleared.tier)}"
    elif kind == "snapshot_begin":
        b = message.snapshot_begin
        detail = f"sessions={b.num_sessions} blocks={b.num_blocks}"
    elif kind == "snapshot_chunk":
        c = message.snapshot_chunk
        detail = f"session={c.session_id or '(none)'} blocks={len(c.blocks)}"
    elif kind == "resync":
        r2 = message.resync
        cause = enum_name(kvhint_pb2.Resync.Cause, "CAUSE_", r2.cause).lower()
        detail = _join(f"cause={cause} current_epoch={r2.current_epoch} oldest={r2.oldest_sequence}", r2.message)
    return f"{head} {detail}".rstrip()
