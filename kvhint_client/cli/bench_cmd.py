"""`kvhint bench`: the agentic benchmark (bench/).

    kvhint bench run [--mode fast|full] [--trace my.jsonl] [--model DIR] ...
        replay a trace on a real vLLM engine: (a) LRU, (b) hints, (c) hints + Release,
        (c2) kvhint_client.policy, (f) vLLM's offloading tiers without hints, (g) hints +
        Demote/Prefetch on the tiers, (g2) kvhint_client.policy on the tiers, plus the offline
        (d) Belady-MIN and (e) infinite-cache references
        (bench.agentic_engine; `kvhint bench run -h` for every option)
    kvhint bench generate|analyze|headroom|policy ...
        the offline tools (bench.cli): generate a trace, simulate every policy on a trace
        (yours or generated) side by side with LRU, Belady, the infinite cache and the tier
        runs, print the reference policy's hints

Everything after the subcommand is passed through to that tool. It takes none of the
global connection options: `run` starts its own engine (or takes `--http/--grpc`).
"""

from __future__ import annotations

import argparse
from typing import Any

from .context import CliContext, UsageError

OFFLINE = ("generate", "analyze", "headroom", "policy")


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="agentic benchmark: replay a trace on vLLM with and without hints, or simulate it offline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("tool", choices=("run", *OFFLINE), help="run: real engine; the others: offline tools")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the tool (see `kvhint bench TOOL -h`)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace, ctx: CliContext) -> int:
    try:
        if args.tool == "run":
            from bench.agentic_engine import main as tool_main

            return int(tool_main(list(args.args)) or 0)
        from bench.cli import main as cli_main

        return int(cli_main([args.tool, *args.args]) or 0)
    except ImportError as error:
        raise UsageError(f"bench needs the repository's bench package and numpy (and vllm for `run`): {error}") from None
    except SystemExit as exit_:  # argparse inside the tool: -h (0) or a usage error (2)
        if isinstance(exit_.code, int) or exit_.code is None:
            return int(exit_.code or 0)
        # SystemExit("message"): the tool's own error (a missing trace, an unknown run); say it
        print(exit_.code, file=ctx.err, flush=True)
        return 2
