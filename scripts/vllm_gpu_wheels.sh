#!/usr/bin/env bash
# The wheels a GPU machine needs for scripts/gpu_check.sh that are not on the project's lent H200
# (bench/results/gpu_check_h200/probe.log: torch 2.11.0+cu130, no vLLM): vLLM 0.32.0's CUDA wheel,
# the torch it pins, and their sizes, against the device tool's 64 MiB per call. Needs a package
# registry; downloads about 850 MB to a temporary folder, removed afterwards.
# Writes OUT (default bench/results/gpu_check_h200/wheels.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-bench/results/gpu_check_h200/wheels.txt}"
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps "${plat[@]}" -d "$tmp" vllm==0.32.0
torch_pin="$(unzip -p "$tmp"/vllm-0.32.0-*.whl '*/METADATA' | grep -E '^Requires-Dist: torch==' | head -1 | sed 's/Requires-Dist: //')"
python3 -m pip download -q --no-deps "${plat[@]}" -d "$tmp" "$torch_pin"
{
  echo "# $(date -u +%F) scripts/vllm_gpu_wheels.sh (pip download --no-deps, CPython 3.12, manylinux x86_64)"
  echo "vllm==0.32.0 pins: $torch_pin"
  for f in "$tmp"/*.whl; do
    python3 -c "import os,sys; p=sys.argv[1]; print(f'{os.path.basename(p)}  {os.path.getsize(p)/1e6:.1f} MB  ({os.path.getsize(p)/2**20:.1f} MiB)')" "$f"
  done
  echo "device tool: at most 64 MiB of working tree per call"
} | tee "$OUT"
