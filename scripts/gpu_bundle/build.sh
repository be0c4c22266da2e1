#!/usr/bin/env bash
# Build the carried GPU bundle: what the project's lent H200 needs to run scripts/gpu_check.sh on
# vLLM 0.32.0, cut into parts that each fit the device tool's 64 MiB per call beside the working
# tree. Run here (a machine with a package registry); scripts/gpu_bundle/run.sh unpacks and runs
# it there (that machine reaches no registry).
#
# Why a bundle (bench/results/gpu_check_h200/README.md): the H200 has Python 3.12 with torch
# 2.11.0+cu130 and no vLLM; vLLM 0.32.0's CUDA wheel is 326.5 MB and pins torch 2.13.0 (526.6 MB).
# What this carries instead, about 83 MB compressed:
#   - vLLM 0.32.0's Python code from that same wheel, and its kernel library
#     `_C_stable_libtorch.abi3.so`. It is built on torch's stable ABI: every torch symbol it needs
#     is exported by torch 2.11.0's libraries (checked with nm; `--check-abi` repeats the check),
#     so it loads against the machine's torch. Left out: FlashAttention's kernels (480.6 MB
#     uncompressed; the shim below steers vLLM to its Triton attention instead), the MoE, FlashMLA,
#     DeepGEMM and other kernels no dense or Gemma2-style model calls, and the `vllm-rs` frontend
#     binary. One edit to vLLM's code: the ImportError vllm_flash_attn/__init__.py raises without
#     FlashAttention's kernels is dropped (drop_fa_import_error.py).
#   - the Python packages in scripts/gpu_bundle/requirements.txt (CPython 3.12 wheels);
#   - kvhint_gpu_bundle_shim.py, a vLLM general plugin (see its docstring).
# So a GPU check run from the bundle is vLLM 0.32.0 on torch 2.11 with Triton attention, not a
# `pip install vllm==0.32.0` machine; its results file says so (run.sh writes that header).
#
# Usage: scripts/gpu_bundle/build.sh [--check-abi]
# Writes .gpu_bundle/part1 ... partN (ignored by git), each holding one slice of bundle.tar.xz and
# MANIFEST (sha256 of the whole and of each slice), and .gpu_bundle/BUILD.txt (sizes). Downloads
# cache in ~/.cache/kvhint/gpu_bundle.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT="$PWD"
CACHE="${KVHINT_GPU_BUNDLE_CACHE:-$HOME/.cache/kvhint/gpu_bundle}"
DEST="$ROOT/.gpu_bundle"
VLLM_VERSION=0.32.0
plat=(--only-binary=:all: --python-version 3.12 --implementation cp)
for p in manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 \
         manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
  plat+=(--platform "$p")
done
mkdir -p "$CACHE/wheels"
python3 -m pip download -q --no-deps "${plat[@]}" -d "$CACHE" "vllm==$VLLM_VERSION"
python3 -m pip download -q --no-deps "${plat[@]}" -d "$CACHE/wheels" -r scripts/gpu_bundle/requirements.txt
VLLM_WHEEL="$(ls "$CACHE"/vllm-$VLLM_VERSION-*.whl)"

if [[ " $* " == *" --check-abi "* ]]; then
  # Every torch symbol the kernel library needs, against torch 2.11.0's exported ones.
  python3 -m pip download -q --no-deps "${plat[@]}" -d "$CACHE/torch211" torch==2.11.0
  t="$(mktemp -d)"; trap 'rm -rf "$t"' EXIT  # replaced below by one trap for both folders
  unzip -q -o "$CACHE"/torch211/torch-2.11.0-*.whl 'torch/lib/libtorch*.so' 'torch/lib/libc10*.so' -d "$t"
  unzip -q -o "$VLLM_WHEEL" 'vllm/_C_stable_libtorch.abi3.so' -d "$t"
  for l in "$t"/torch/lib/*.so; do nm -D --defined-only "$l" | awk '{print $NF}'; done | sort -u >"$t/defined"
  nm -D --undefined-only "$t/vllm/_C_stable_libtorch.abi3.so" | awk '{print $NF}' | grep -v '@' | sort -u >"$t/needed"
  missing="$(comm -23 "$t/needed" "$t/defined" | grep -E '^(_Z|aoti_|torch_)' || true)"
  if [ -n "$missing" ]; then echo "torch symbols torch 2.11.0 lacks:"; echo "$missing"; exit 1; fi
  echo "gpu_bundle: every torch symbol _C_stable_libtorch needs is in torch 2.11.0"
fi

stage="$(mktemp -d)"; trap 'rm -rf "$stage" ${t:+"$t"}' EXIT
site="$stage/site"; mkdir -p "$site"
# vLLM's Python code and its stable-ABI kernel library; not the other compiled parts.
unzip -q "$VLLM_WHEEL" -d "$site" -x 'vllm/vllm-rs' 'vllm/third_party/fmha_sm100/*' \
  'vllm/third_party/deep_gemm/*' 'vllm/third_party/tml_fa4/*' '*.so'
unzip -q "$VLLM_WHEEL" 'vllm/_C_stable_libtorch.abi3.so' -d "$site"
# vllm/vllm_flash_attn/__init__.py raises ImportError when neither FlashAttention kernel library is
# there, and vLLM's CUDA code imports it unguarded (v1/attention/backends/fa_utils.py), so without
# the kernels no engine starts (the first bundle run on the H200 died so). The bundle drops that one
# raise; its flash_attn_interface already reports FA2/FA3 unavailable, and the shim keeps the
# FlashAttention backend out of vLLM's choice. The build fails if vLLM's text is not as expected.
python3 scripts/gpu_bundle/drop_fa_import_error.py "$site/vllm/vllm_flash_attn/__init__.py"
# grep's own status is dropped (it is 1 when pip prints nothing else), pip's is not (pipefail): a
# failed install stops the build instead of packing a bundle without these packages.
python3 -m pip install -q --no-deps --no-compile "${plat[@]}" --target "$site" "$CACHE"/wheels/*.whl 2>&1 \
  | { grep -v "Running pip as the 'root'" || true; }
cp scripts/gpu_bundle/kvhint_gpu_bundle_shim.py "$site/"
di="$site/kvhint_gpu_bundle_shim-0.1.dist-info"; mkdir -p "$di"
printf 'Metadata-Version: 2.1\nName: kvhint-gpu-bundle-shim\nVersion: 0.1\n' >"$di/METADATA"
printf '[vllm.general_plugins]\nkvhint_gpu_bundle = kvhint_gpu_bundle_shim:register\n' >"$di/entry_points.txt"
rm -rf "$site/bin"
tar cf - -C "$site" . | xz -T0 -6 >"$stage/bundle.tar.xz"

# Parts: each beside the working tree (tracked + untracked files) within 64 MiB, 1 MiB spare.
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s+=$1} END {print s+0}')
room=$(( 64 * 1048576 - tree - 1048576 ))
total=$(stat -c %s "$stage/bundle.tar.xz")
parts=$(( (total + room - 1) / room ))
size=$(( (total + parts - 1) / parts ))
rm -rf "$DEST"; mkdir -p "$DEST"
(cd "$stage" && split -b "$size" -d -a 2 bundle.tar.xz bundle.tar.xz.)
{
  echo "vllm $VLLM_VERSION bundle, built $(date -u +%FT%TZ) by scripts/gpu_bundle/build.sh"
  echo "parts $parts"
  (cd "$stage" && sha256sum bundle.tar.xz bundle.tar.xz.*)
} >"$stage/MANIFEST"
i=0
for s in "$stage"/bundle.tar.xz.*; do
  i=$((i + 1)); mkdir -p "$DEST/part$i"
  mv "$s" "$DEST/part$i/"; cp "$stage/MANIFEST" "$DEST/part$i/"
done
# What went in and what was left out, with sizes (bench/results/gpu_check_h200/bundle_build.txt is
# this file from the build the H200 runs used).
{
  echo "# scripts/gpu_bundle/build.sh, $(date -u +%F): vLLM $VLLM_VERSION bundle"
  echo "bundle.tar.xz: $total bytes in $parts parts of at most $size; working tree $tree bytes; limit per call $((64 * 1048576))"
  echo "compiled parts of $(basename "$VLLM_WHEEL") (uncompressed bytes; carried: _C_stable_libtorch only):"
  unzip -l "$VLLM_WHEEL" | awk '$4 ~ /\.so$|vllm-rs$/ {print "  " $1 "  " $4}' | sort -k1,1nr
} | tee "$DEST/BUILD.txt"
