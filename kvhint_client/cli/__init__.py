"""The `kvhint` command line (console script `kvhint = kvhint_client.cli:main`).

    kvhint [--address HOST:PORT] [--timeout S] [--json] COMMAND ...

Commands come from the modules listed in COMMAND_MODULES. A command module defines

    def register(subparsers, common: argparse.ArgumentParser) -> None

which adds its parser(s) with `parents=[common]` (the global options) and
`set_defaults(run=run)`, where `run(args, ctx: CliContext) -> int` returns the exit code.
A command that talks to no KvHint server takes `parents=[context.output_options()]` (--json
only) or no parent (`demo`), so its help lists no connection options it would ignore.
To add commands (e.g. `demo`, `bench`), append the module path to COMMAND_MODULES or pass
`modules=` to main()/build_parser(). Exit codes are documented in cli/context.py:
0 ok, 1 negative answer, 2 usage, 3 unavailable, 4 other server error.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Optional

from ..errors import KvHintError
from .context import EXIT_USAGE, CliContext, UsageError, add_global_options, describe_error

COMMAND_MODULES: list[str] = [
    "kvhint_client.cli.inspect_cmds",
    "kvhint_client.cli.apply_cmd",
    "kvhint_client.cli.watch_cmd",
    "kvhint_client.cli.model_cmd",
    "kvhint_client.cli.demo_cmd",
    "kvhint_client.cli.bench_cmd",
]

__all__ = ["COMMAND_MODULES", "CliContext", "build_parser", "main"]


def build_parser(modules: Optional[Sequence[str]] = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvhint",
        description="Talk to a KvHint (kvhint.v1) server: session-aware KV-cache hints for LLM engines.",
        epilog="exit codes: 0 ok, 1 not all hints ACCEPTED / not serving / watch resync, "
        "2 usage error (incl. INVALID_ARGUMENT), 3 unavailable or deadline exceeded, 4 other server error",
    )
    add_global_options(parser, suppress=False)
    common = argparse.ArgumentParser(add_help=False)
    add_global_options(common, suppress=True)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES if modules is None else modules:
        importlib.import_module(name).register(subparsers, common)
    return parser


def main(argv: Optional[Sequence[str]] = None, *, modules: Optional[Sequence[str]] = None) -> int:
    parser = build_parser(modules)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse: --help (0) or a usage error (2, message printed)
        return int(exit_.code or 0)
    if not getattr(args, "run", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    ctx = CliContext(args)
    try:
        return int(args.run(args, ctx))
    except UsageError as error:
        ctx.fail(str(error))
        return EXIT_USAGE
    except KvHintError as error:
        message, code = describe_error(error, ctx)
        ctx.fail(message)
        return code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`kvhint watch | head`); stop quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    finally:
        ctx.close()
