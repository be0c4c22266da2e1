"""Generate the kvhint.v1 bindings from proto/kvhint/v1/kvhint.proto.

One command for every committed binding:
  python tools/gen_proto.py           # regenerate in place
  python tools/gen_proto.py --check   # fail if committed bindings are stale

Python (+ .pyi stubs) comes from grpcio-tools' bundled protoc, so the
generated code matches the installed protobuf runtime; the stubs come from
mypy-protobuf. Go comes from `buf generate` (buf.gen.yaml) with Debian's
protoc-gen-go / protoc-gen-go-grpc. Rust is generated at build time by
prost-build (gen/rust/build.rs) and is not committed.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTO = "kvhint/v1/kvhint.proto"
PY_OUT = ROOT  # generates kvhint/v1/kvhint_pb2*.py(i)
GO_OUT = ROOT / "gen" / "go"
PY_FILES = [
    "kvhint/v1/kvhint_pb2.py",
    "kvhint/v1/kvhint_pb2.pyi",
    "kvhint/v1/kvhint_pb2_grpc.py",
    "kvhint/v1/kvhint_pb2_grpc.pyi",
]
GO_FILES = [
    "kvhint/v1/kvhint.pb.go",
    "kvhint/v1/kvhint_grpc.pb.go",
]


def _generate_python(out: Path) -> None:
    from grpc_tools import protoc  # type: ignore[import-untyped]

    bin_dir = Path(sys.executable).parent
    env_path = os.environ.get("PATH", "")
    os.environ["PATH"] = f"{bin_dir}{os.pathsep}{env_path}"
    well_known = Path(protoc.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--mypy_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_grpc_out={out}",
        PROTO,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("grpc_tools.protoc failed")


def _generate_go(out: Path) -> bool:
    if not (shutil.which("buf") and shutil.which("protoc-gen-go") and shutil.which("protoc-gen-go-grpc")):
        print("gen_proto: buf/protoc-gen-go/protoc-gen-go-grpc not found; skipping Go", file=sys.stderr)
        return False
    template = (ROOT / "buf.gen.yaml").read_text().replace("out: gen/go", f"out: {out}")
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as fh:
        fh.write(template)
    try:
        subprocess.run(["buf", "generate", "--template", fh.name], cwd=ROOT, check=True)
    finally:
        os.unlink(fh.name)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if committed bindings are stale")
    args = parser.parse_args()

    if not args.check:
        _generate_python(PY_OUT)
        _generate_go(GO_OUT)
        print("gen_proto: bindings regenerated")
        return 0

    stale: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp_py = Path(tmp) / "py"
        tmp_go = Path(tmp) / "go"
        tmp_py.mkdir()
        _generate_python(tmp_py)
        pairs = [(tmp_py / f, PY_OUT / f) for f in PY_FILES]
        if _generate_go(tmp_go):
            pairs += [(tmp_go / f, GO_OUT / f) for f in GO_FILES]
        for fresh, committed in pairs:
            if not committed.exists() or not filecmp.cmp(fresh, committed, shallow=False):
                stale.append(str(committed.relative_to(ROOT)))
    if stale:
        print("gen_proto: stale generated code (run `python tools/gen_proto.py`):", file=sys.stderr)
        for path in stale:
            print(f"  {path}", file=sys.stderr)
        return 1
    print("gen_proto: generated code is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
