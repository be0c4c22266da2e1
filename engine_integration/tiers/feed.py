"""ResidencyFeed: lower-tier residency (host, file) into the SessionPrefixIndex.

The runtime taps the connector's `OffloadingManager.take_events` (full offload
keys, medium CPU / STORAGE; the connector drains them once per step). Host
stores and file writes mark the index (`core.on_stored` with tier HOST / DISK),
host and file evictions call `core.on_removed`. A block whose G1 copy is
evicted while a lower-tier copy remains therefore keeps its session
membership. It also answers "which lower tiers hold this block" for the
adapter's lookups and removals.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from vllm.v1.kv_offload.base import Medium, get_offload_block_hash, get_offload_group_idx

from kvhint_server.model import RemovalCause, Tier

from .control import HostState, TierControl
from .hashes import HashBook

_MEDIUM = {Medium.CPU: (Tier.HOST, "CPU"), Medium.STORAGE: (Tier.DISK, "STORAGE")}


class ResidencyFeed:
    def __init__(
        self,
        core: Any,
        ctl: TierControl,
        book: HashBook,
        *,
        external: Callable[[bytes], bytes],
        on_device: Callable[[bytes], bool],
    ) -> None:
        self.core = core
        self.ctl = ctl
        self.book = book
        self._external = external
        self._on_device = on_device
        self.has_file = bool(ctl.file_tiers)
        self.counters: dict[str, int] = {}

    # ------------------------------------------------------------ residency queries

    def host_ready(self, d: bytes) -> bool:
        return self.ctl.host_state(d) is HostState.READY

    def on_file(self, ext: bytes, d: bytes) -> bool:
        """A file tier holds the block, for lookups: the book's answer for a block seen there
        (no stat; the tier emits no removal, so a file deleted underneath stays reported until
        an operation probes it, `file_has`), a probe otherwise."""
        if not self.has_file:
            return False
        if ext in self.book.on_disk:
            return True
        return self.file_has(ext, d)

    def file_has(self, ext: bytes, d: bytes) -> bool:
        """A file tier holds the block, probed (an operation that needs the file): a block
        seen there whose file went is reported gone (`_file_gone`)."""
        if not self.has_file:
            return False
        if self.ctl.file_has(d):
            self.book.mark_disk(ext)
            return True
        if ext in self.book.on_disk:
            self._file_gone([ext])
        return False

    def _file_gone(self, exts: list[bytes]) -> None:
        """A probe found no file for blocks seen on a file tier: removed underneath KvHint
        (another engine's ephemeral tier, an operator). Forgotten, and BlocksRemoved(DISK)
        for the copies the index had there, as for a removal event from the tier."""
        self.book.forget_disk(exts)
        published = self.core.resident[Tier.DISK]
        gone = [e for e in exts if e in published]
        if gone:
            self.core.on_removed(gone, tier=Tier.DISK, medium="STORAGE", cause=RemovalCause.EVICTED,
                                 remaining_tiers=self.remaining_tiers)

    def file_settled(self, ext: bytes, d: bytes, inflight: set[Any], *, recheck: bool = False) -> bool:
        """A file copy exists and its write job was processed (so its BlockStored
        event precedes anything an operation publishes about it). A block seen there is
        settled without a stat unless `recheck` (an operation's start: `file_has`)."""
        if ext in self.book.on_disk:
            return not recheck or self.file_has(ext, d)
        if not self.has_file or not self.ctl.file_has(d):
            return False
        if any(self.ctl.key(d, g) in inflight for g in self.ctl.group_ids):
            return False
        self.book.mark_disk(ext)
        return True

    def _mask(self, h: bytes, d: bytes | None) -> int:
        if d is None:
            return 0
        mask = Tier.HOST.bit if self.host_ready(d) else 0
        if self.on_file(h, d):
            mask |= Tier.DISK.bit
        return mask

    def lower_tiers_of(self, h: bytes) -> int:
        """Tier bitmask of the valid HOST / DISK copies of wire hash `h`."""
        return self._mask(h, self.book.digest_of(h))

    def residual_tiers(self, h: bytes) -> int:
        """`lower_tiers_of` for the eviction path (a G1 copy of a block no session
        tracks just went): only blocks this runtime saw stored are checked, so an
        evicted decode block costs a dict lookup, not a file-system probe."""
        return self._mask(h, self.book.known_digest(h))

    def remaining_tiers(self, h: bytes) -> int:
        mask = self.lower_tiers_of(h)
        if self._on_device(h):
            mask |= Tier.DEVICE.bit
        return mask

    # ------------------------------------------------------------ events in

    def reconcile(self, exts: Iterable[bytes]) -> None:
        """Before G1 copies of tracked blocks are reported removed: record lower-tier
        copies the index has not seen (copies that predate the block's index node,
        e.g. promoted from a shared file tier before the request admitted it)."""
        index = self.core.index
        host, disk = [], []
        for h in exts:
            node = index.node(h)
            if node is None:
                continue
            missing = ~node.tiers & (Tier.HOST.bit | Tier.DISK.bit)
            if not missing:
                continue
            mask = self.residual_tiers(h)
            if mask & missing & Tier.HOST.bit:
                host.append(h)
            if mask & missing & Tier.DISK.bit:
                disk.append(h)
        if host:
            self.publish_stored(host, Tier.HOST, "CPU")
        if disk:
            self.publish_stored(disk, Tier.DISK, "STORAGE")

    def on_manager_events(self, events: list[Any]) -> None:
        presence = self.ctl.required_group_ids[0]  # one event per logical block: its first required group's
        for ev in events:
            tier_medium = _MEDIUM.get(ev.medium)
            if tier_medium is None:
                continue
            tier, medium = tier_medium
            exts: list[bytes] = []
            for key in ev.keys:
                if get_offload_group_idx(key) != presence:
                    continue
                d = bytes(get_offload_block_hash(key))
                e = self._external(d)
                exts.append(e)
                if not ev.removed:
                    self.book.remember(e, d)
                    if tier is Tier.DISK:
                        self.book.mark_disk(e)
            if not exts:
                continue
            name = ("host_" if tier is Tier.HOST else "disk_") + ("removed" if ev.removed else "stored")
            self.counters[name] = self.counters.get(name, 0) + len(exts)
            if ev.removed:
                if tier is Tier.DISK:
                    self.book.forget_disk(exts)
                self.core.on_removed(exts, tier=tier, medium=medium, cause=RemovalCause.EVICTED,
                                     remaining_tiers=self.remaining_tiers)
            else:
                self.publish_stored(exts, tier, medium)

    def publish_stored(self, exts: list[bytes], tier: Tier, medium: str) -> None:
        """BlocksStored per chain run for blocks the index tracks (chain order,
        real positions); one event for the rest (position unknown: 0)."""
        nodes = self.core.index.nodes
        tracked = sorted((h for h in dict.fromkeys(exts) if h in nodes), key=lambda h: nodes[h].position)
        untracked = [h for h in dict.fromkeys(exts) if h not in nodes]
        run: list[bytes] = []

        def flush() -> None:
            if run:
                first = nodes[run[0]]
                self.core.on_stored(list(run), first_position=first.position, parent=first.parent,
                                    tier=tier, medium=medium, coords=None)
                run.clear()

        for h in tracked:
            if run and nodes[h].parent != run[-1]:
                flush()
            run.append(h)
        flush()
        if untracked:
            self.core.on_stored(untracked, first_position=0, parent=None, tier=tier, medium=medium, coords=None)
