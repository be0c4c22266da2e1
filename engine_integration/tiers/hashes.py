"""HashBook: wire hashes <-> vLLM block hashes for the tier runtime, and aliases.

The wire carries vLLM's *external* hash (with int hashes, the digest's last 8
bytes), but the offloading tiers are keyed by the full digest. The book keeps,
each bounded to DIGEST_MAP_CAP entries in LRU order:

  * wire hash -> digest for blocks seen stored on a lower tier;
  * wire hashes seen written to a file tier;
  * wire hashes whose G1 copy a Demote made the first eviction candidate.

Alias files (`<file tier>_kvhint_alias/<hex[:3]>/<hex>` holding the digest)
let another engine that shares the file tier map a wire hash it never stored
back to the file name.
"""

from __future__ import annotations

import contextlib
import glob
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from kvhint_server.model import RemovalCause

DIGEST_MAP_CAP = 1 << 18
ALIAS_SUFFIX = "_kvhint_alias"


def _touch(lru: OrderedDict[bytes, object], key: bytes, value: object = None) -> None:
    lru[key] = value
    lru.move_to_end(key)
    while len(lru) > DIGEST_MAP_CAP:
        lru.popitem(last=False)


class HashBook:
    def __init__(
        self,
        *,
        int_hashes: bool,
        external: Callable[[bytes], bytes],
        device_digest: Callable[[bytes], bytes | None],
        file_tier_paths: Sequence[str],
    ) -> None:
        """`external(digest)` is the wire form; `device_digest(ext)` the digest of
        a block the device pool holds (None when it holds none)."""
        self.int_hashes = int_hashes
        self._external = external
        self._device_digest = device_digest
        self.alias_dirs = [p + ALIAS_SUFFIX for p in file_tier_paths]
        self._digest: OrderedDict[bytes, object] = OrderedDict()   # wire hash -> vLLM block hash
        self.on_disk: OrderedDict[bytes, object] = OrderedDict()   # wire hashes seen on a file tier
        self._demoted: OrderedDict[bytes, object] = OrderedDict()  # G1 copies a Demote made first candidates

    # ------------------------------------------------------------ digests

    def remember(self, ext: bytes, digest: bytes) -> None:
        _touch(self._digest, ext, digest)

    def known_digest(self, ext: bytes) -> bytes | None:
        """The digest of a block this runtime saw stored (no probing)."""
        if not self.int_hashes:
            return ext
        return self._digest.get(ext)  # type: ignore[return-value]

    def digest_of(self, ext: bytes, *, aliases: bool = True) -> bytes | None:
        """vLLM block hash (digest) for a wire hash, or None when unknown."""
        if not self.int_hashes:
            return ext
        d = self._digest.get(ext)
        if d is not None:
            return d  # type: ignore[return-value]
        d = self._device_digest(ext)
        if d is not None:
            return d
        if aliases and self.alias_dirs:
            d = self.read_alias(ext)
            if d is not None:
                self.remember(ext, d)
            return d
        return None

    def mark_disk(self, ext: bytes) -> None:
        _touch(self.on_disk, ext)

    def forget_disk(self, exts: Iterable[bytes]) -> None:
        for e in exts:
            self.on_disk.pop(e, None)

    # ------------------------------------------------------------ demoted copies

    def mark_demoted(self, exts: Iterable[bytes]) -> None:
        for e in exts:
            _touch(self._demoted, e)

    def split_removed(self, exts: list[bytes], cause: RemovalCause) -> list[tuple[list[bytes], RemovalCause]]:
        """G1 removals in runs by cause: an ordinary eviction of a G1 copy that a
        Demote made the first candidate is reported as DEMOTED."""
        demoted = self._demoted
        if cause is not RemovalCause.EVICTED or not demoted:
            return [(exts, cause)]
        runs: list[tuple[list[bytes], RemovalCause]] = []
        for e in exts:
            c = RemovalCause.DEMOTED if demoted.pop(e, 0) is None else cause
            if runs and runs[-1][1] is c:
                runs[-1][0].append(e)
            else:
                runs.append(([e], c))
        return runs

    # ------------------------------------------------------------ alias files

    @staticmethod
    def _alias_path(base: str, ext: bytes) -> str:
        h = ext.hex()
        return os.path.join(base, h[:3], h)

    def read_alias(self, ext: bytes) -> bytes | None:
        for base in self.alias_dirs:
            try:
                with open(self._alias_path(base, ext)) as f:
                    d = bytes.fromhex(f.read().strip())
            except (OSError, ValueError):
                continue
            if self._external(d) == ext:
                return d
        return None

    def write_aliases(self, exts: Sequence[bytes], digests: Sequence[bytes]) -> None:
        """wire hash -> digest records beside the shared files (worker thread)."""
        for base in self.alias_dirs:
            for ext, d in zip(exts, digests):
                path = self._alias_path(base, ext)
                if os.path.exists(path):
                    continue
                os.makedirs(os.path.dirname(path), exist_ok=True)
                tmp = f"{path}.{os.getpid()}.tmp"
                with open(tmp, "w") as f:
                    f.write(d.hex())
                os.replace(tmp, path)

    def remove_alias_tmp(self) -> None:
        """Temporary alias files this process left (at shutdown)."""
        for base in self.alias_dirs:
            for path in glob.glob(os.path.join(glob.escape(base), "*", f"*.{os.getpid()}.tmp")):
                with contextlib.suppress(OSError):
                    os.unlink(path)
