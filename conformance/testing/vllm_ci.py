"""The CI job: serve the vLLM integration (tiny model, block_size 32, 80 device blocks,
max_model_len 1024, KvHint sidecar) and run the whole conformance suite against it.

    python -m conformance.testing.vllm_ci [--junit-xml FILE] [any kvhint-conformance option]

The engine is stopped (its whole process group) before this returns. Exit status is the
suite's. Known failures of the vLLM integration are listed in vllm_known_failing.txt.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .. import runner

KNOWN_FAILING = Path(__file__).with_name("vllm_known_failing.txt")


def main(argv: list[str] | None = None) -> int:
    from engine_integration.served import EngineSpec, ServedEngine, default_model

    spec = EngineSpec(model=default_model("tiny"))
    engine = ServedEngine(spec)
    engine.start()
    try:
        args = [
            "--target", engine.grpc_address, "--openai-url", engine.http_url,
            "--max-model-len", str(spec.max_model_len), "--known-failing", str(KNOWN_FAILING),
        ]  # fmt: skip
        return runner.main(args + list(sys.argv[1:] if argv is None else argv))
    finally:
        engine.stop()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
