"""The CI job: serve the vLLM integration (a generated model, block_size 32, 80 device blocks,
max_model_len 1024, KvHint sidecar) and run the whole conformance suite against it.

    python -m conformance.testing.vllm_ci [--preset tiny|hybrid] [--junit-xml FILE] [any kvhint-conformance option]

`--preset` picks the generated model (engine_integration.served.default_model): `tiny`, a dense
Llama (default), or `hybrid`, a Gemma2-style model with sliding-window layers. The engine is
stopped (its whole process group) before this returns. Exit status is the suite's.

Known failures of the vLLM integration are listed in vllm_known_failing.txt, the one source of
truth: the CI run passes it as --known-failing (a listed case that passes fails the run as
stale), and the tests that expect a case to fail under a fault ask `is_known_failing`.
"""

from __future__ import annotations

import fnmatch
import sys
from pathlib import Path

from .. import runner

KNOWN_FAILING = Path(__file__).with_name("vllm_known_failing.txt")
PRESETS = ("tiny", "hybrid")


def known_failing_patterns(path: Path = KNOWN_FAILING) -> list[str]:
    """The ids (or globs) listed in a known-failing file, comments and blanks dropped."""
    return runner.parse_known_failing(path.read_text())


def is_known_failing(case_id: str, path: Path = KNOWN_FAILING) -> bool:
    return any(fnmatch.fnmatchcase(case_id, p) for p in known_failing_patterns(path))


def main(argv: list[str] | None = None) -> int:
    from engine_integration.served import EngineSpec, ServedEngine, default_model

    args = list(sys.argv[1:] if argv is None else argv)
    preset = "tiny"
    if "--preset" in args:
        i = args.index("--preset")
        preset = args[i + 1] if i + 1 < len(args) else ""
        del args[i : i + 2]
        if preset not in PRESETS:
            print(f"vllm_ci: --preset must be one of {', '.join(PRESETS)}", file=sys.stderr)
            return 2
    spec = EngineSpec(model=default_model(preset))
    engine = ServedEngine(spec)
    engine.start()
    try:
        base = [
            "--target", engine.grpc_address, "--openai-url", engine.http_url,
            "--max-model-len", str(spec.max_model_len), "--known-failing", str(KNOWN_FAILING),
        ]  # fmt: skip
        return runner.main(base + args)
    finally:
        engine.stop()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
