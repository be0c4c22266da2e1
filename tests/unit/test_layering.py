"""The dependency arrows point one way: the engine-neutral core never imports
vLLM, torch, the vLLM integration or the client; the client does not import them
at module level (its `demo` / `make-tiny-model` commands and the envelope's
msgspec conversion load them lazily, only when used)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FORBIDDEN = {
    "kvhint_server": ("vllm", "torch", "engine_integration", "kvhint_client"),
    "kvhint_client": ("vllm", "torch", "engine_integration", "kvhint_server"),
}
LAZY_ALLOWED = {"kvhint_client"}  # function-level imports allowed


def _imports(path: Path, top_level_only: bool) -> list[str]:
    out = []
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    for node in nodes:
        if isinstance(node, ast.Import):
            out.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append(node.module)
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_no_engine_code(package):
    bad = [
        f"{p.relative_to(REPO)}: {name}"
        for p in sorted((REPO / package).rglob("*.py"))
        for name in _imports(p, top_level_only=package in LAZY_ALLOWED)
        if name.split(".")[0] in FORBIDDEN[package]
    ]
    assert not bad, "forbidden imports:\n" + "\n".join(bad)


def test_core_imports_without_vllm_installed():
    """Importing every core module with vllm and torch made unimportable succeeds."""
    code = (
        "import sys, importlib, pkgutil\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('vllm', 'torch'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import kvhint_server\n"
        "for m in pkgutil.walk_packages(kvhint_server.__path__, 'kvhint_server.'):\n"
        "    importlib.import_module(m.name)\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
