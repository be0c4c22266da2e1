//! Generates the kvhint.v1 message types from proto/kvhint/v1/kvhint.proto
//! with prost-build. protoc comes from $PROTOC (default /usr/bin/protoc,
//! Debian's protobuf-compiler); the well-known types (Duration, Timestamp)
//! map to prost-types.

use std::env;
use std::path::PathBuf;

fn main() -> std::io::Result<()> {
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let proto_root = manifest_dir.join("../../proto");
    let proto = proto_root.join("kvhint/v1/kvhint.proto");

    // prost-build 0.11 reads PROTOC itself; default it to Debian's protoc so
    // a plain `cargo build` works without extra environment.
    if env::var_os("PROTOC").is_none() {
        env::set_var("PROTOC", "/usr/bin/protoc");
    }
    // Debian's protoc ships the well-known .proto files here; pass it as an
    // include path only if PROTOC_INCLUDE was not given.
    let mut includes = vec![proto_root.clone()];
    if let Some(inc) = env::var_os("PROTOC_INCLUDE") {
        includes.push(PathBuf::from(inc));
    } else if PathBuf::from("/usr/include/google/protobuf/duration.proto").exists() {
        includes.push(PathBuf::from("/usr/include"));
    }

    println!("cargo:rerun-if-changed={}", proto.display());
    println!("cargo:rerun-if-env-changed=PROTOC");
    println!("cargo:rerun-if-env-changed=PROTOC_INCLUDE");

    prost_build::Config::new().compile_protos(&[proto], &includes)
}
