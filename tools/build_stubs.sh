#!/usr/bin/env bash
# Build the kvhint.v1 Go and Rust stubs offline, against Debian bookworm's
# packaged libraries (no Go module proxy, no crates.io).
#
#   tools/build_stubs.sh            # both sections
#   tools/build_stubs.sh go         # Go only
#   tools/build_stubs.sh rust       # Rust only
#
# go:   GOPATH mode (GO111MODULE=off) over /usr/share/gocode. Builds the
#       generated package gen/go/kvhint/v1, vets it, runs the example's
#       in-process gRPC round trip (go test) and writes the example binary
#       build/bin/kvhint-capabilities (static, CGO_ENABLED=0).
#       Debian packages: golang-go golang-google-grpc-dev
#       golang-google-protobuf-dev golang-github-golang-protobuf-1-5-dev
#       (NOT -1-3-dev: it compiles, but grpc's codec panics at run time).
# rust: cargo --offline in gen/rust with gen/rust/.cargo/config.toml pointing
#       crates-io at /usr/share/cargo/registry. prost-build generates the
#       messages at build time with $PROTOC (default /usr/bin/protoc); then
#       cargo test. Messages only: tonic is not packaged in bookworm.
#       Debian packages: protobuf-compiler libprotobuf-dev
#       librust-prost-dev librust-prost-types-dev librust-prost-build-dev
#       (+ a cargo/rustc >= 1.63; bookworm's own cargo 0.66 is fine).
#
# Output goes to build/ (and gen/rust/target/, gen/rust/Cargo.lock), all
# gitignored. Re-running is cheap: Go and cargo caches live under build/ and
# gen/rust/target/, and unchanged inputs are not rebuilt.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
BUILD="$ROOT/build"
BIN="$BUILD/bin"
GO_IMPORT="github.com/kvhint/kvhint"
DEBIAN_GOCODE="${DEBIAN_GOCODE:-/usr/share/gocode}"
DEBIAN_CARGO_REGISTRY="/usr/share/cargo/registry"

log() { printf 'build_stubs: %s\n' "$*"; }
die() { printf 'build_stubs: error: %s\n' "$*" >&2; exit 1; }
elapsed() { echo "$(( $(date +%s) - $1 ))s"; }

build_go() {
    local t0; t0=$(date +%s)
    command -v go >/dev/null || die "go not found (apt-get install golang-go)"
    [ -d "$DEBIAN_GOCODE/src/google.golang.org/grpc" ] \
        || die "$DEBIAN_GOCODE/src/google.golang.org/grpc missing (apt-get install golang-google-grpc-dev)"
    [ -d "$DEBIAN_GOCODE/src/google.golang.org/protobuf" ] \
        || die "$DEBIAN_GOCODE/src/google.golang.org/protobuf missing (apt-get install golang-google-protobuf-dev)"
    # grpc-go 1.33's codec goes through github.com/golang/protobuf/proto.
    # Debian's 1.3 package (an allowed alternative of golang-google-grpc-dev)
    # is the old reflection-based runtime: protoc-gen-go 1.28 output compiles
    # against it but every RPC panics on decode. 1.4+ wraps
    # google.golang.org/protobuf; detect that.
    grep -qs '"google.golang.org/protobuf/' "$DEBIAN_GOCODE"/src/github.com/golang/protobuf/proto/*.go \
        || die "github.com/golang/protobuf in $DEBIAN_GOCODE is the 1.3 API; apt-get install golang-github-golang-protobuf-1-5-dev (replaces -1-3-dev)"

    # A private GOPATH entry that maps the go_package import path onto the
    # checkout; refreshed every run so a moved checkout still works.
    local gopath="$BUILD/gopath"
    mkdir -p "$gopath/src/${GO_IMPORT%/*}" "$BIN"
    ln -sfn "$ROOT" "$gopath/src/$GO_IMPORT"

    export GO111MODULE=off GOFLAGS= GOPROXY=off GOTOOLCHAIN=local
    export GOPATH="$gopath:$DEBIAN_GOCODE"
    export GOCACHE="${GOCACHE:-$BUILD/go-cache}"
    export CGO_ENABLED="${CGO_ENABLED:-0}"
    local pkgs=("$GO_IMPORT/gen/go/kvhint/v1" "$GO_IMPORT/examples/go/capabilities")

    cd "$BUILD"   # outside the checkout's own tree: nothing picks up a go.mod
    log "go: $(go version | cut -d' ' -f3-), GOPATH=$GOPATH"
    go build "${pkgs[@]}"
    go vet "${pkgs[@]}"
    go test "$GO_IMPORT/examples/go/capabilities"
    go build -o "$BIN/kvhint-capabilities" "$GO_IMPORT/examples/go/capabilities"
    log "go: built package $GO_IMPORT/gen/go/kvhint/v1 (gen/go/kvhint/v1)"
    log "go: built $BIN/kvhint-capabilities  [$(elapsed "$t0")]"
}

build_rust() {
    local t0; t0=$(date +%s)
    command -v cargo >/dev/null || die "cargo not found"
    export PROTOC="${PROTOC:-/usr/bin/protoc}"
    [ -x "$PROTOC" ] || die "protoc not found at $PROTOC (apt-get install protobuf-compiler)"
    [ -f /usr/include/google/protobuf/duration.proto ] || [ -n "${PROTOC_INCLUDE:-}" ] \
        || die "google/protobuf/*.proto not found (apt-get install libprotobuf-dev)"
    local c
    for c in prost prost-types prost-build; do
        compgen -G "$DEBIAN_CARGO_REGISTRY/$c-0.11.*" >/dev/null \
            || die "$c 0.11 not in $DEBIAN_CARGO_REGISTRY (apt-get install librust-$c-dev)"
    done

    # Cargo finds gen/rust/.cargo/config.toml (the Debian directory source)
    # from the current directory, not from --manifest-path: cd there.
    cd "$ROOT/gen/rust"
    log "rust: $(cargo --version), PROTOC=$PROTOC ($("$PROTOC" --version))"
    cargo build --offline --lib --examples
    cargo test --offline --quiet
    local gen
    gen=$(ls -t target/debug/build/kvhint-proto-*/out/kvhint.v1.rs 2>/dev/null | head -n1)
    [ -n "$gen" ] || die "prost-build output kvhint.v1.rs not found"
    mkdir -p "$BIN" "$BUILD/rust"
    cp -f "$gen" "$BUILD/rust/kvhint.v1.rs"
    cp -f target/debug/examples/encode_hint "$BIN/kvhint-encode-hint"
    log "rust: built crate kvhint-proto (messages only; tonic not in Debian bookworm): gen/rust/target/debug/libkvhint_proto.rlib"
    log "rust: generated code copied to $BUILD/rust/kvhint.v1.rs"
    log "rust: built $BIN/kvhint-encode-hint  [$(elapsed "$t0")]"
}

sections=("$@")
[ ${#sections[@]} -gt 0 ] || sections=(go rust)
for s in "${sections[@]}"; do
    case "$s" in
        go) (build_go) ;;
        rust) (build_rust) ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown section '$s' (expected: go, rust)" ;;
    esac
done
