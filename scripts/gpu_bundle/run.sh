#!/usr/bin/env bash
# The lent GPU machine's side of the carried bundle (scripts/gpu_bundle/build.sh). Each device call
# carries some of .gpu_bundle/partN; the machine keeps them in STORE while it stays warm.
#
#   scripts/gpu_bundle/run.sh stash                 # keep the carried parts, nothing else
#   scripts/gpu_bundle/run.sh check [ARGS...]       # keep these too, check every part against
#                                                   # MANIFEST, unpack, run the smoke check, then
#                                                   # scripts/gpu_check.sh ARGS
#
# `check` writes to OUT (the device tool's folder; default ./gpu_bundle_out):
#   bundle_env.txt          the machine, torch, the bundle's MANIFEST, whether vLLM's kernel library
#                           loaded, and the environment the check ran with;
#   gpu_check_results.md / .json   scripts/gpu_check.sh's results file, unchanged;
#   smoke.log               scripts/gpu_bundle/smoke.py's output: one engine per model, four tokens
#                           (KVHINT_GPU_BUNDLE_SMOKE=0 skips it);
#   gpu_check_logs.tgz      its step logs.
# Exit status: gpu_check.sh's; 2 when a part is missing or damaged (bundle_env.txt says which); 3
# when the smoke check failed (gpu_check.sh then does not run: its steps would each fail in turn).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT="$PWD"
STORE="${KVHINT_GPU_BUNDLE_STORE:-/tmp/kvhint_gpu_bundle}"
PARTS="${KVHINT_GPU_BUNDLE_PARTS:-.gpu_bundle}"  # where the carried parts arrive
OUTDIR="${OUT:-$ROOT/gpu_bundle_out}"
mode="${1:-}"; shift || true
mkdir -p "$STORE" "$OUTDIR"
for d in "$PARTS"/part*; do
  [ -d "$d" ] && cp "$d"/bundle.tar.xz.* "$d"/MANIFEST "$STORE"/
done
ls -l "$STORE"
case "$mode" in
  stash) exit 0 ;;
  check) ;;
  *) echo "usage: $0 stash | check [gpu_check.sh args]" >&2; exit 2 ;;
esac

ENV_TXT="$OUTDIR/bundle_env.txt"
{
  echo "# scripts/gpu_bundle/run.sh check $*  ($(date -u +%FT%TZ))"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  python3 -c "import sys,torch;print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda, torch.cuda.is_available())" 2>&1
  echo "--- MANIFEST"; cat "$STORE/MANIFEST" 2>&1
} >"$ENV_TXT"
want=$(awk '/^parts /{print $2}' "$STORE/MANIFEST" 2>/dev/null)
have=$(ls "$STORE"/bundle.tar.xz.?? 2>/dev/null | wc -l)
if [ -z "$want" ] || [ "$have" != "$want" ]; then
  echo "bundle incomplete: $have of ${want:-?} parts on this machine" | tee -a "$ENV_TXT"; exit 2
fi
if ! (cd "$STORE" && cat bundle.tar.xz.?? >bundle.tar.xz && grep -E '^[0-9a-f]{64} ' MANIFEST | sha256sum -c --quiet) >>"$ENV_TXT" 2>&1; then
  echo "bundle damaged: sha256 mismatch" | tee -a "$ENV_TXT"; exit 2
fi
SITE="$STORE/site"
rm -rf "$SITE"; mkdir -p "$SITE"
xz -dc "$STORE/bundle.tar.xz" | tar xf - -C "$SITE" || { echo "bundle did not unpack" | tee -a "$ENV_TXT"; exit 2; }

# The bundle's packages first, then the repository (every child process the check starts, vLLM's
# EngineCore included, inherits both).
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# Eager engines: vLLM 0.32.0's compilation passes are written against torch 2.13's Inductor, and the
# machine has torch 2.11 (the bundle does not carry torch). The caller's value wins.
export KVHINT_ENFORCE_EAGER="${KVHINT_ENFORCE_EAGER:-1}"
export KVHINT_BENCH_ENFORCE_EAGER="${KVHINT_BENCH_ENFORCE_EAGER:-1}"  # bench/step_overhead.py
# vLLM's own switch for its FlashInfer top-k/top-p sampler: the bundle carries no FlashInfer, and
# vLLM 0.32.0's V2 model runner imports it unguarded when the switch is on (the second bundle run
# on the H200 died so: bench/results/gpu_check_h200/bundle_run2/).
export VLLM_USE_FLASHINFER_SAMPLER="${VLLM_USE_FLASHINFER_SAMPLER:-0}"
{
  echo "--- vLLM from the bundle"
  python3 - <<'EOF' 2>&1
import torch, vllm
print("vllm", vllm.__version__, "from", vllm.__file__)
try:
    import vllm._C_stable_libtorch  # noqa: F401
    print("vllm._C_stable_libtorch: loaded; torch.ops._C.rms_norm:", hasattr(torch.ops._C, "rms_norm"))
except Exception as e:  # noqa: BLE001
    print("vllm._C_stable_libtorch: FAILED", repr(e))
import kvhint_gpu_bundle_shim as s
print("FlashAttention kernels load:", s.flash_attention_kernels_load())
EOF
  echo "--- environment"
  env | grep -E '^(KVHINT_|VLLM_|PYTHONPATH=|CUDA_)' | sort
} >>"$ENV_TXT"

if [ "${KVHINT_GPU_BUNDLE_SMOKE:-1}" = 1 ]; then
  python3 scripts/gpu_bundle/smoke.py >"$OUTDIR/smoke.log" 2>&1
  src=$?
  grep '^smoke: ' "$OUTDIR/smoke.log" >>"$ENV_TXT"
  echo "smoke.py exit $src" | tee -a "$ENV_TXT"
  if [ "$src" != 0 ]; then
    tail -60 "$OUTDIR/smoke.log"
    exit 3
  fi
fi
GC="$STORE/gc"; rm -rf "$GC"
scripts/gpu_check.sh --out "$GC" "$@" 2>&1 | tail -40
rc=${PIPESTATUS[0]}
echo "gpu_check.sh exit $rc" | tee -a "$ENV_TXT"
cp "$GC"/gpu_check_results.md "$GC"/gpu_check_results.json "$OUTDIR"/ 2>/dev/null
tar czf "$OUTDIR/gpu_check_logs.tgz" -C "$STORE" gc 2>/dev/null
exit "$rc"
