"""`kvhint apply ACTION <selector> [bounds]` and `kvhint apply --envelope FILE`.

Exit 0 when every hint was ACCEPTED, 1 when any was CLIPPED / DEFERRED / REJECTED / MISSING.
With `--wait SECONDS`, a DEFERRED hint's operation (Demote, Prefetch, Share) is waited for, and
counts as ACCEPTED when it SUCCEEDED: exit 0 when every hint was ACCEPTED or its operation
succeeded, 1 when one failed or was still unfinished when the wait ran out.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from kvhint.v1 import kvhint_pb2

from ..envelope import EnvelopeError, envelope_to_hints
from ..names import outcome_name, reason_name
from ..proto_json import message_to_dict
from ..results import ApplyResult
from .context import EXIT_NEGATIVE, EXIT_OK, CliContext, UsageError
from .output import counts_text, result_detail, table
from .selector_args import add_selector_options, target_from_args

ACTIONS = ("pin", "retain", "release", "evict", "demote", "prefetch", "share")
# Which bound flags each action takes (anything else given is a usage error).
_ACTION_FLAGS: dict[str, set[str]] = {
    "pin": {"ttl"},
    "retain": {"ttl", "priority"},
    "release": set(),
    "evict": set(),
    "demote": {"target_tier"},
    "prefetch": {"deadline"},
    "share": {"destination"},
}
_REQUIRED: dict[str, set[str]] = {"pin": {"ttl"}, "retain": {"ttl"}, "share": {"destination"}}
_FLAG_NAMES = {"ttl": "--ttl", "priority": "--priority", "target_tier": "--target-tier",
               "deadline": "--deadline", "destination": "--destination"}


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser(
        "apply",
        parents=[common],
        help="apply one hint (or a KvHintsEnvelope)",
        description="Apply one hint. Exit 0 if ACCEPTED, 1 otherwise (CLIPPED, DEFERRED, REJECTED, MISSING); "
        "with --wait, a DEFERRED hint whose operation SUCCEEDED counts as ACCEPTED.",
        epilog="examples:\n  kvhint apply pin --session agent-7 --ttl 30\n"
        "  kvhint apply retain --session agent-7 --include-children --priority 5 --ttl 60\n"
        "  kvhint apply demote --continuation c1 --range 0:4 --target-tier host --wait 30\n"
        "  kvhint apply --envelope hints.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("action", nargs="?", choices=ACTIONS, metavar="ACTION", help=f"one of: {', '.join(ACTIONS)}")
    add_selector_options(parser)
    bounds = parser.add_argument_group("bounds")
    bounds.add_argument("--ttl", type=float, metavar="SECONDS", help="pin / retain: how long (required)")
    bounds.add_argument("--priority", type=int, help="retain: higher is kept longer (default 0)")
    bounds.add_argument("--target-tier", metavar="TIER", help="demote: device|host|disk|remote (default: nearest lower)")
    bounds.add_argument("--deadline", type=float, metavar="SECONDS", help="prefetch: give up after this long")
    bounds.add_argument("--destination", metavar="PEER", help="share: peer host:port or shared tier name (required)")
    bounds.add_argument("--max-blocks", type=int, default=0, metavar="N", help="touch at most N blocks (0: no cap)")
    bounds.add_argument("--hint-id", metavar="ID", help="idempotency key (default: a generated uuid4)")
    parser.add_argument(
        "--wait", type=float, default=None, metavar="SECONDS",
        help="wait up to SECONDS for DEFERRED hints' operations (Demote, Prefetch, Share) to finish; "
        "exit 0 only if each SUCCEEDED",
    )
    parser.add_argument(
        "--envelope", metavar="FILE", help="apply a KvHintsEnvelope JSON file ('-' for stdin) instead of one hint"
    )
    parser.set_defaults(run=run)


def _hint_from_args(args: argparse.Namespace) -> kvhint_pb2.Hint:
    action = args.action
    given = {name for name in _FLAG_NAMES if getattr(args, name) is not None}
    extra = given - _ACTION_FLAGS[action]
    if extra:
        raise UsageError(f"{', '.join(sorted(_FLAG_NAMES[n] for n in extra))} does not apply to {action}")
    missing = _REQUIRED.get(action, set()) - given
    if missing:
        raise UsageError(f"{action} needs {', '.join(sorted(_FLAG_NAMES[n] for n in missing))}")
    target = target_from_args(args)
    common = {"hint_id": args.hint_id, "max_blocks": args.max_blocks}
    try:
        if action == "pin":
            return target.pin(args.ttl, **common)
        if action == "retain":
            return target.retain(args.ttl, args.priority or 0, **common)
        if action == "release":
            return target.release(**common)
        if action == "evict":
            return target.evict(**common)
        if action == "demote":
            return target.demote(args.target_tier, **common)
        if action == "prefetch":
            return target.prefetch(args.deadline, **common)
        return target.share(args.destination, **common)
    except ValueError as error:
        raise UsageError(str(error)) from None


def _hints_from_envelope(path: str) -> list[kvhint_pb2.Hint]:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise UsageError(f"cannot read {path}: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise UsageError(f"cannot read {path}: not UTF-8 JSON ({error.reason} at byte {error.start})") from None
    try:
        hints = envelope_to_hints(text)
    except EnvelopeError as error:
        # The envelope-level messages already name it ("envelope: missing 'protocol_version'");
        # the action-level ones ("action 0 (id 'a'): ...") get the prefix.
        message = str(error)
        raise UsageError(message if message.startswith("envelope") else f"envelope: {message}") from None
    except RecursionError:  # json.loads on arrays / objects nested thousands deep
        raise UsageError(f"envelope {path}: not valid JSON (nested too deeply)") from None
    if not hints:
        raise UsageError("envelope: it has no actions (nothing to apply)")
    return hints


def run(args: argparse.Namespace, ctx: CliContext) -> int:
    if args.envelope:
        if args.action:
            raise UsageError("give either an action or --envelope, not both")
        # the envelope's actions carry their own selectors and bounds: these flags would be ignored
        ignored = [flag for flag, value in (
            ("--session", args.session), ("--include-children", args.include_children),
            ("--continuation", args.continuation), ("--block-hash", args.block_hash), ("--range", args.range),
            *((_FLAG_NAMES[name], getattr(args, name) is not None) for name in _FLAG_NAMES),
            ("--max-blocks", args.max_blocks), ("--hint-id", args.hint_id is not None)) if value]
        if ignored:
            raise UsageError(f"{', '.join(ignored)} does not apply with --envelope (the envelope's actions give "
                             "their own selectors and bounds)")
        hints = _hints_from_envelope(args.envelope)
    elif not args.action:
        raise UsageError(f"choose an action ({', '.join(ACTIONS)}) or --envelope FILE")
    else:
        hints = [_hint_from_args(args)]
    if args.wait is not None and not args.wait > 0:
        raise UsageError("--wait must be a number of seconds > 0")
    result = ctx.client().apply(*hints)
    operations = _wait_operations(ctx, result, args.wait) if args.wait is not None else None
    if ctx.json:
        out = apply_result_json(result)
        if operations is not None:
            out["operations"] = [message_to_dict(op) for op in operations.values()]
        ctx.emit_json(out)
    else:
        ctx.print(apply_result_table(result))
        if operations:
            ctx.print(operations_table(operations, args.wait))
    if operations is None:
        return EXIT_OK if result.all_accepted else EXIT_NEGATIVE
    ok = all(r.outcome == kvhint_pb2.OUTCOME_ACCEPTED
             or (r.outcome == kvhint_pb2.OUTCOME_DEFERRED and _succeeded(operations.get(r.operation_id)))
             for r in result.results)
    return EXIT_OK if ok else EXIT_NEGATIVE


_FINAL = (kvhint_pb2.Operation.STATE_SUCCEEDED, kvhint_pb2.Operation.STATE_FAILED)
POLL_S = 0.2


def _succeeded(operation: kvhint_pb2.Operation | None) -> bool:
    return operation is not None and operation.state == kvhint_pb2.Operation.STATE_SUCCEEDED


def _wait_operations(ctx: CliContext, result: ApplyResult, wait: float) -> dict[str, kvhint_pb2.Operation]:
    """The DEFERRED hints' operations as last read (GetOperation), each polled until it finished
    or the one `wait` shared by all ran out."""
    deadline = time.monotonic() + wait
    out: dict[str, kvhint_pb2.Operation] = {}
    for r in result.results:
        if r.outcome != kvhint_pb2.OUTCOME_DEFERRED or not r.operation_id:
            continue
        while True:
            op = out[r.operation_id] = ctx.client().get_operation(r.operation_id)
            left = deadline - time.monotonic()
            if op.state in _FINAL or left <= 0:
                break
            time.sleep(min(POLL_S, left))
    return out


def operations_table(operations: dict[str, kvhint_pb2.Operation], wait: float) -> str:
    rows = []
    for op_id, op in operations.items():
        state = kvhint_pb2.Operation.State.Name(op.state).removeprefix("STATE_")
        detail = op.message if op.state in _FINAL else f"not finished after --wait {wait:g}s"
        rows.append((op_id, state, reason_name(op.reason), detail))
    return table(("OPERATION", "STATE", "REASON", "DETAIL"), rows)


def apply_result_json(result: ApplyResult) -> dict[str, Any]:
    response = kvhint_pb2.ApplyHintsResponse(
        results=result.results, epoch=result.epoch, applied_at_sequence=result.applied_at_sequence
    )
    out = message_to_dict(response)
    out.setdefault("results", [])
    out["all_accepted"] = result.all_accepted
    return out


def apply_result_table(result: ApplyResult) -> str:
    rows = [
        (r.hint_id, outcome_name(r.outcome), reason_name(r.reason), counts_text(r.affected_blocks), r.operation_id,
         result_detail(r))
        for r in result.results
    ]
    return table(("HINT", "OUTCOME", "REASON", "BLOCKS", "OPERATION", "DETAIL"), rows)
