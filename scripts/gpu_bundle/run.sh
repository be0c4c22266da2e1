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
#
# The whole call fits KVHINT_GPU_BUNDLE_LIMIT_S (default 570 s, under the device tool's 600 s per
# call): the smoke check runs under `timeout` with what is left, and gpu_check.sh gets
# `--budget <seconds left>` unless ARGS give one. gpu_check.sh writes straight under OUT, so a
# call that is cut short still brings back what it wrote.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT="$PWD"
STORE="${KVHINT_GPU_BUNDLE_STORE:-/tmp/kvhint_gpu_bundle}"
PARTS="${KVHINT_GPU_BUNDLE_PARTS:-.gpu_bundle}"  # where the carried parts arrive
OUTDIR="${OUT:-$ROOT/gpu_bundle_out}"
mode="${1:-}"; shift || true
LIMIT_S="${KVHINT_GPU_BUNDLE_LIMIT_S:-570}"
left() { echo $((LIMIT_S - SECONDS)); }
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
# An earlier check's files in OUT never pass for this one's: a check that stops before gpu_check.sh
# (exit 2 or 3), or whose gpu_check.sh writes no results, would leave them beside its bundle_env.txt.
rm -f "$OUTDIR"/gpu_check_results.md "$OUTDIR"/gpu_check_results.json "$OUTDIR"/smoke.log "$OUTDIR"/gpu_check_logs.tgz

ENV_TXT="$OUTDIR/bundle_env.txt"
{
  echo "# scripts/gpu_bundle/run.sh check $*  ($(date -u +%FT%TZ))"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  python3 -c "import sys,torch;print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda, torch.cuda.is_available())" 2>&1
  echo "--- MANIFEST"; cat "$STORE/MANIFEST" 2>&1
} >"$ENV_TXT"
want=$(awk '/^parts /{print $2}' "$STORE/MANIFEST" 2>/dev/null)
# Only the slices this MANIFEST names (.00 .. want-1): a STORE kept from a build with more parts
# may hold stale ones.
slices=()
if [ -n "$want" ]; then
  for ((i = 0; i < want; i++)); do slices+=("bundle.tar.xz.$(printf %02d "$i")"); done
fi
have=0
for f in "${slices[@]}"; do [ -f "$STORE/$f" ] && have=$((have + 1)); done
if [ -z "$want" ] || [ "$have" != "$want" ]; then
  echo "bundle incomplete: $have of ${want:-?} parts on this machine" | tee -a "$ENV_TXT"; exit 2
fi
if ! (cd "$STORE" && cat "${slices[@]}" >bundle.tar.xz && grep -E '^[0-9a-f]{64} ' MANIFEST | sha256sum -c --quiet) >>"$ENV_TXT" 2>&1; then
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
import torch
print("torch", torch.__version__)  # read back below for the results header
import vllm
print("vllm", vllm.__version__, "from", vllm.__file__)
try:
    import vllm._C_stable_libtorch  # noqa: F401
    print("vllm._C_stable_libtorch: loaded; torch.ops._C.rms_norm:", hasattr(torch.ops._C, "rms_norm"))
except Exception as e:  # noqa: BLE001
    print("vllm._C_stable_libtorch: FAILED", repr(e))
import kvhint_gpu_bundle_shim as s
print("FlashAttention kernels load:", s.flash_attention_kernels_load())
EOF
} >>"$ENV_TXT"
# The results header says what ran (build.sh's promise): not a pip install of vllm==0.32.0. The torch
# version is the one the block above printed (a third torch import would take seconds of the lease).
torch_version=$(awk '/^--- vLLM from the bundle/ { b = 1 } b && /^torch / { print $2; exit }' "$ENV_TXT")
export KVHINT_GPU_CHECK_NOTE="run from the offline GPU bundle (scripts/gpu_bundle): vLLM 0.32.0 on torch ${torch_version:-?} with the bundle's shim and FlashAttention's import error dropped, not a pip install of vllm==0.32.0; the machine and the bundle are in bundle_env.txt"
{
  echo "--- environment"
  env | grep -E '^(KVHINT_|VLLM_|PYTHONPATH=|CUDA_)' | sort
} >>"$ENV_TXT"

if [ "${KVHINT_GPU_BUNDLE_SMOKE:-1}" = 1 ]; then
  # At most a third of what is left: the check itself needs the rest.
  timeout --kill-after=10 "$(( $(left) / 3 ))" python3 scripts/gpu_bundle/smoke.py >"$OUTDIR/smoke.log" 2>&1
  src=$?
  [ "$src" = 124 ] && echo "smoke: timed out" >>"$OUTDIR/smoke.log"
  grep '^smoke: ' "$OUTDIR/smoke.log" >>"$ENV_TXT"
  echo "smoke.py exit $src" | tee -a "$ENV_TXT"
  if [ "$src" != 0 ]; then
    tail -60 "$OUTDIR/smoke.log"
    exit 3
  fi
fi
GC="$OUTDIR/gc"; rm -rf "$GC"
budget=()
case " $* " in *" --budget "*|*" --budget="*) ;; *) budget=(--budget "$(( $(left) - 15 ))") ;; esac
echo "gpu_check.sh ${budget[*]} $* ($(left) s left of $LIMIT_S)" >>"$ENV_TXT"
scripts/gpu_check.sh --out "$GC" "${budget[@]}" "$@" 2>&1 | tail -40
rc=${PIPESTATUS[0]}
echo "gpu_check.sh exit $rc" | tee -a "$ENV_TXT"
cp "$GC"/gpu_check_results.md "$GC"/gpu_check_results.json "$OUTDIR"/ 2>/dev/null
tar czf "$OUTDIR/gpu_check_logs.tgz" -C "$OUTDIR" gc 2>/dev/null && rm -rf "$GC"
exit "$rc"
