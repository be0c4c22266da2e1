"""`kvhint demo`: start vLLM (CPU) on the generated tiny model with the KvHint
sidecar and run the two-agent Pin scenario (engine_integration.demo)."""

from __future__ import annotations

import argparse
from typing import Any

from .context import CliContext, UsageError


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    # None of the global options: the demo starts its own engine and sidecar on free ports (their
    # addresses are printed) and prints text, so --address, --tls, --token, --json ... would do nothing.
    parser = subparsers.add_parser(
        "demo", help="run vLLM with the sidecar and a two-agent scenario, with and without a Pin"
    )
    parser.add_argument("--model", help="model directory (default: generate the tiny model)")
    parser.add_argument("--log", help="engine log file (default: a temp file)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace, ctx: CliContext) -> int:
    try:
        from engine_integration.demo import main as demo_main
    except ImportError as error:
        raise UsageError(f"demo needs the engine extras (pip install 'kvhint[vllm]'): {error}") from None
    argv = [*(["--model", args.model] if args.model else []), *(["--log", args.log] if args.log else [])]
    return demo_main(argv)
