"""Selector flags shared by `apply` and `residency`:
--session S [--include-children] | --continuation C | --block-hash HEX (repeatable), and
--range START:END (END may be empty: to the end of the chain)."""

from __future__ import annotations

import argparse
from typing import Optional

from ..builders import Target, blocks, continuation, session
from .context import UsageError


def add_selector_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("selector (exactly one of --session, --continuation, --block-hash)")
    group.add_argument("--session", metavar="ID", help="all blocks of a session")
    group.add_argument("--include-children", action="store_true", help="with --session: also its child sessions")
    group.add_argument("--continuation", metavar="ID", help="the prefix chain ending at a continuation")
    group.add_argument(
        "--block-hash", action="append", default=[], metavar="HEX", help="an explicit block hash in hex (repeatable)"
    )
    group.add_argument("--range", metavar="START:END", help="half-open chain positions, e.g. 0:4 or 8: (to the end)")


def parse_range(text: str) -> tuple[int, Optional[int]]:
    start_text, sep, end_text = text.partition(":")
    if not sep:
        raise UsageError(f"--range must look like START:END or START:, got {text!r}")
    try:
        start = int(start_text) if start_text else 0
        end = int(end_text) if end_text else None
    except ValueError:
        raise UsageError(f"--range must be integers START:END, got {text!r}") from None
    return start, end


# What each selector flag's value names, for the message when it is given empty (`--session ""`).
_VALUE_OF = {"--session": "a session id", "--continuation": "a continuation id",
             "--block-hash": "a block hash in hex", "--range": "START:END or START:"}


def _reject_empty_values(args: argparse.Namespace) -> None:
    """A selector flag given with an empty value is a usage error that names the flag: an empty id
    selects nothing, and an empty --range would otherwise be dropped (the whole chain selected)."""
    for flag, values in (("--session", [args.session]), ("--continuation", [args.continuation]),
                         ("--block-hash", args.block_hash), ("--range", [args.range])):
        if "" in values:
            raise UsageError(f"{flag} is empty: give {_VALUE_OF[flag]}")


def target_from_args(args: argparse.Namespace) -> Target:
    _reject_empty_values(args)
    given = [flag for flag, value in (("--session", args.session), ("--continuation", args.continuation),
                                      ("--block-hash", args.block_hash)) if value]
    if len(given) != 1:
        raise UsageError(
            "give exactly one selector: --session, --continuation or --block-hash"
            + (f" (got {', '.join(given)})" if given else "")
        )
    if args.include_children and not args.session:
        raise UsageError("--include-children needs --session")
    try:
        if args.session:
            target = session(args.session, include_children=args.include_children)
        elif args.continuation:
            target = continuation(args.continuation)
        else:
            target = blocks(*args.block_hash)
        if args.range:
            target = target.range(*parse_range(args.range))
    except ValueError as error:
        raise UsageError(str(error)) from None
    return target
