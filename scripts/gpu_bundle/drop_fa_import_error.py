"""Drop the ImportError vLLM 0.32.0's vllm/vllm_flash_attn/__init__.py raises when neither
FlashAttention kernel library is present (scripts/gpu_bundle/build.sh: the bundle does not carry
them). Exits 1, changing nothing, unless that block is there exactly once.

Usage: python3 drop_fa_import_error.py PATH/vllm/vllm_flash_attn/__init__.py
"""

from __future__ import annotations

import re
import sys

BLOCK = re.compile(r"if not \(FA2_AVAILABLE or FA3_AVAILABLE\):\n    raise ImportError\(\n(?:        .*\n)+    \)\n")
NOTE = "# (KvHint GPU bundle: FlashAttention's kernels are not carried, so the ImportError is dropped)\n"


def main(path: str) -> int:
    with open(path) as f:
        text = f.read()
    new, n = BLOCK.subn(NOTE, text)
    if n != 1:
        print(f"gpu_bundle: {path}: the FlashAttention ImportError block found {n} times, expected once", file=sys.stderr)
        return 1
    with open(path, "w") as f:
        f.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
