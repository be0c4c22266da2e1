#!/usr/bin/env bash
# What a lent GPU machine has for the GPU check, and what scripts/gpu_check.sh does there as it is
# (no install step: such a machine may reach no package registry). Writes OUT/probe.log (OUT: the
# first argument, default $OUT, else ./device_probe_out). This is the command whose log is
# bench/results/gpu_check_h200/probe.log (one NVIDIA H200, 2026-12-04). Exit status: gpu_check.sh's.
OUT="${1:-${OUT:-device_probe_out}}"
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"
cd "$(dirname "$0")/.."
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import sys,torch;print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0))"
  echo '--- pip show vllm'; python3 -m pip show vllm 2>&1 | head -2
  echo '--- pip install --no-index vllm==0.32.0'; python3 -m pip install --no-index vllm==0.32.0 2>&1 | tail -2
  echo '--- versions'; python3 -m pip list 2>/dev/null | grep -iE '^(torch|grpcio|protobuf|transformers|vllm|triton) '
  echo '--- scripts/gpu_check.sh'; mkdir -p "$OUT/gc"; time scripts/gpu_check.sh --out "$OUT/gc"; rc=$?
  echo "gpu_check exit $rc"; ls -la "$OUT/gc"; exit "$rc"
} 2>&1 | tee "$OUT/probe.log"
exit "${PIPESTATUS[0]}"  # gpu_check.sh's status, not tee's
