"""TierRuntime: Demote / Prefetch / Share on vLLM's OffloadingConnector, inside EngineCore.

The KvHint executor resolves a tier hint to block hashes and calls
`VllmAdapter.start_tier_task`, which lands in `TierRuntime.start` on the engine
thread. Engine-side work then progresses in `on_step()` (called by
`KvHintScheduler.schedule()` every step); work that waits on another engine
runs on a worker thread and hands its result back through `KvHintCore.submit`.
Every operation completes exactly once (`OperationRegistry.complete`) and has a
deadline, so none can hang.

What each action does (see README.md "Control surface" for the vLLM internals):

* Demote{target HOST|DISK}: blocks whose host copy is READY need nothing;
  blocks whose host store is in flight are waited for; blocks only in G1 (for
  example decode blocks: the connector offloads prompt blocks only) are copied
  by an injected store job (`TierControl.force_store`). For target DISK the
  file-tier copy is waited for (host -> file cascades are automatic; a READY host
  copy without a file is cascaded explicitly). When every selected block has a
  valid copy on the target tier the operation SUCCEEDS, a TierTransferCompleted
  is published, and only then the G1 copies become the first eviction
  candidates (`adapter.demote_first`): copy completion and reclamation are
  separate steps. G1 copies stay reusable until a later allocation takes them.
* Prefetch: the connector loads into G1 only for a request it is admitting
  (`update_state_after_alloc`), so Prefetch stages copies in the host tier:
  file-only blocks are promoted file -> host (`control.Prefetch`), host copies
  are refreshed to most-recently-used, and the resume request then loads from
  host memory. A Prefetch of blocks that are all on G1 is ACCEPTED as a no-op by
  the executor.
* Share{destination}: the source makes every selected block valid in the shared
  file tier (force store / cascade, as for Demote to DISK), records
  hash aliases next to the files when the wire hash is the 64-bit int form (the
  destination cannot derive the file name from it), then, from a worker thread,
  sends the destination's own KvHint endpoint a Prefetch of those block hashes
  and polls its GetOperation. The Share operation SUCCEEDS only when the
  destination's Prefetch SUCCEEDED, i.e. the data is in the destination's host
  tier; the destination reports nothing before that.

Residency feed: the runtime wraps the connector's `OffloadingManager.take_events`
(full offload keys, medium CPU / STORAGE), which the connector drains once per
step. Host stores and file writes mark the SessionPrefixIndex (`core.on_stored`
with tier HOST / DISK), host evictions call `core.on_removed`. A block whose G1
copy is evicted while a lower-tier copy remains therefore keeps its session
membership. vLLM's managers produce these events only with
`kv_events_config.enable_kv_cache_events`; when that is off the runtime turns
the managers' event lists on itself and consumes the events (vLLM's publisher,
which would drop them, never sees them).
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.kv_offload.base import (
    Medium,
    ReqContext,
    get_offload_block_hash,
    get_offload_group_idx,
)

from kvhint_server.adapter import TierRefusal, TierTask
from kvhint_server.model import Action, ActionSupport, Reason, RemovalCause, SelectorKind, Tier, TierInfo

from .control import HostState, Prefetch, StoreOp, TierControl

log = logging.getLogger("kvhint.tiers")

ALL_SELECTORS = (SelectorKind.SESSION, SelectorKind.CONTINUATION, SelectorKind.BLOCK_HASHES)
DEFAULT_OP_TIMEOUT_S = 60.0
MAX_PENDING_OPS = 64
MAX_STORE_RETRIES = 3
DIGEST_MAP_CAP = 1 << 18
ALIAS_SUFFIX = "_kvhint_alias"
_MEDIUM = {Medium.CPU: (Tier.HOST, "CPU"), Medium.STORAGE: (Tier.DISK, "STORAGE")}
_ids = itertools.count()


class Phase(enum.Enum):
    COPY = "copy"        # engine side: make copies valid on the target tier
    REMOTE = "remote"    # Share: a worker thread waits for the destination
    DONE = "done"


@dataclass
class TierOp:
    op_id: str
    action: Action
    target: Tier
    exts: tuple[bytes, ...]          # wire hashes, chain order
    digests: list[bytes]             # vLLM block hashes (offload key without group)
    deadline: float                  # monotonic
    phase: Phase = Phase.COPY
    store: StoreOp | None = None
    store_tries: int = 0
    prefetch: Prefetch | None = None
    cascaded: set[bytes] = field(default_factory=set)
    stored_blocks: int = 0           # G1 -> host copies this op made
    written_blocks: int = 0          # host -> file copies this op caused
    promoted: list[bytes] = field(default_factory=list)  # file -> host (Prefetch)
    destination: str = ""
    address: str = ""


def parse_peers(raw: Any) -> dict[str, str]:
    """`{"b": "host:port"}` or "b=host:port,c=host:port" (also ';' or '+') -> dict."""
    if not raw:
        return {}
    if isinstance(raw, dict):
        return {str(k): str(v) for k, v in raw.items()}
    out: dict[str, str] = {}
    for item in str(raw).replace(";", ",").replace("+", ",").split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, address = item.partition("=")
        if not sep or not name or not address:
            raise ValueError(f"share peer {item!r}: expected NAME=HOST:PORT")
        out[name.strip()] = address.strip()
    return out


class _Control(TierControl):
    """TierControl whose `busy()` also counts the runtime's engine-side operations,
    so `connector.has_pending_push_work()` keeps EngineCore stepping for them."""

    runtime: TierRuntime | None = None

    def busy(self) -> bool:
        rt = self.runtime
        return super().busy() or (rt is not None and rt.needs_steps())


class TierRuntime:
    # ------------------------------------------------------------ construction

    @classmethod
    def maybe_create(cls, scheduler: Any, adapter: Any) -> TierRuntime | None:
        """A runtime when the scheduler's connector is an OffloadingConnector whose
        manager KvHint can drive (CPU host tier, optional secondary tiers,
        blocks_per_chunk 1); None otherwise (tier actions stay unadvertised)."""
        try:
            ctl = _Control(scheduler)
        except ValueError:
            log.info("kvhint tiers: KV connector %s is not an OffloadingConnector; tier hints disabled",
                     type(getattr(scheduler, "connector", None)).__name__)
            return None
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

        if not isinstance(ctl.primary, CPUOffloadingManager):
            log.warning("kvhint tiers: offloading manager %s has no CPU host tier; tier hints disabled",
                        type(ctl.manager).__name__)
            return None
        if ctl.blocks_per_chunk != 1:
            log.warning("kvhint tiers: blocks_per_chunk=%d (KvHint needs 1); tier hints disabled",
                        ctl.blocks_per_chunk)
            return None
        return cls(scheduler, adapter, ctl)

    def __init__(self, scheduler: Any, adapter: Any, ctl: _Control) -> None:
        self.scheduler = scheduler
        self.adapter = adapter
        self.core = adapter.core
        self.ctl = ctl
        ctl.runtime = self
        kvt = scheduler.vllm_config.kv_transfer_config
        extra = dict(getattr(kvt, "kv_connector_extra_config", None) or {})
        self.peers = parse_peers(extra.get("kvhint_share_peers"))
        self.peers.update(parse_peers(os.environ.get("KVHINT_SHARE_PEERS", "")))
        self.op_timeout_s = float(
            os.environ.get("KVHINT_TIER_OP_TIMEOUT_S") or extra.get("kvhint_tier_op_timeout_s") or DEFAULT_OP_TIMEOUT_S
        )
        self.bytes_per_block = self._bytes_per_block(scheduler)
        self.int_hashes = bool(getattr(adapter, "_int_hashes", False))
        self.has_file = bool(ctl.file_tiers)
        self.alias_dirs = [t.file_mapper.base_path + ALIAS_SUFFIX for t in ctl.file_tiers]
        self._digest: OrderedDict[bytes, bytes] = OrderedDict()  # wire hash -> vLLM block hash
        self._on_disk: OrderedDict[bytes, None] = OrderedDict()  # wire hashes seen written to a file tier
        self._demoted: OrderedDict[bytes, None] = OrderedDict()  # G1 copies a Demote made first candidates
        self._ops: dict[str, TierOp] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._channels: dict[str, Any] = {}
        self._channels_lock = threading.Lock()
        self._closed = False
        self.counters: dict[str, int] = {}
        self._manager_down = False
        ctl.install()
        self._tap_manager_events(scheduler)
        self._wrap_reset()
        self._wrap_shutdown()
        log.info(
            "kvhint tiers: host %d blocks%s, %d B/block, share peers %s",
            ctl.host_capacity(), ", file tier " + ", ".join(self.alias_dirs) if self.has_file else "",
            self.bytes_per_block, sorted(self.peers) or "none",
        )

    @staticmethod
    def _bytes_per_block(scheduler: Any) -> int:
        cfg = scheduler.kv_cache_config
        try:
            return int(sum(t.size for t in cfg.kv_cache_tensors) // cfg.num_blocks)
        except (AttributeError, ZeroDivisionError, TypeError):
            return 0

    def _tap_manager_events(self, scheduler: Any) -> None:
        """See every OffloadingEvent (full offload keys) before the connector
        translates them; turn event production on where vLLM left it off."""
        manager = self.ctl.manager
        kv_events = getattr(scheduler.vllm_config, "kv_events_config", None)
        self._vllm_events = bool(kv_events is not None and kv_events.enable_kv_cache_events)
        if self.ctl.primary.events is None:
            self.ctl.primary.events = []
        for tier in self.ctl.file_tiers:
            if getattr(tier, "events", None) is None:
                tier.events = []
        orig = manager.take_events

        def take_events() -> Iterable[Any]:
            events = list(orig())
            if events:
                try:
                    self._on_manager_events(events)
                except Exception:  # noqa: BLE001 - never break the engine step
                    log.exception("kvhint tiers: residency feed failed")
            return events if self._vllm_events else ()

        manager.take_events = take_events

    def _wrap_reset(self) -> None:
        manager = self.ctl.manager
        orig = manager.reset_cache

        def reset_cache() -> None:
            orig()
            # An injected store still in flight completes against the reset manager;
            # keep the tiering manager's per-request store count consistent for it.
            req_state = getattr(manager, "_req_state", None)
            if req_state is not None:
                for store in self.ctl._ops.values():
                    st = req_state.get(store._ctx.req_id) if store._ctx is not None else None
                    if st is not None:
                        st.pending_primary_stores += 1
            for op in list(self._ops.values()):
                if op.phase is Phase.COPY:
                    self._fail(op, Reason.OPERATION_FAILED, "the KV connector cache was reset")
            self.core.on_cleared(Tier.HOST)

        manager.reset_cache = reset_cache

    def _wrap_shutdown(self) -> None:
        """Run the tier teardown (pending operations failed, file-tier writes
        drained, ephemeral tiers removed) as soon as EngineCore leaves its busy
        loop, before vLLM tears the executor down.

        `vllm serve` on SIGTERM: EngineCore resets SIGTERM to the default action
        and the API server's process manager sends it another SIGTERM at once, so
        `Scheduler.shutdown` (after the executor's) rarely runs. The teardown
        therefore runs at the loop exit with SIGTERM ignored for its duration; the
        parent's `--shutdown-timeout` (the launcher sets one with --kvhint-tiers)
        bounds it with SIGKILL.
        """
        manager = self.ctl.manager
        orig_manager_shutdown = manager.shutdown

        def manager_shutdown() -> None:
            if self._manager_down:
                return
            self._manager_down = True
            orig_manager_shutdown()

        manager.shutdown = manager_shutdown
        engine: Any = getattr(self.adapter, "_engine_core", None)
        orig_handle = getattr(engine, "_handle_shutdown", None)
        if engine is None or orig_handle is None:
            return

        def handle_shutdown() -> bool:
            keep_running = orig_handle()
            if not keep_running:
                self.teardown()
            return keep_running

        engine._handle_shutdown = handle_shutdown

    def teardown(self) -> None:
        """Engine thread, once, at shutdown: `shutdown()`, then the connector
        manager's own shutdown (file-tier writes drained; ephemeral tiers deleted)."""
        if self._manager_down:
            return
        import signal

        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            self.shutdown()
            self.ctl.manager.shutdown()
            self._remove_alias_tmp()
        except Exception:  # noqa: BLE001 - best effort at exit
            log.exception("kvhint tiers: teardown failed")
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    def _remove_alias_tmp(self) -> None:
        import glob

        for base in self.alias_dirs:
            for path in glob.glob(os.path.join(glob.escape(base), "*", f"*.{os.getpid()}.tmp")):
                with contextlib.suppress(OSError):
                    os.unlink(path)

    # ------------------------------------------------------------ capabilities

    def tier_infos(self) -> tuple[TierInfo, ...]:
        infos = [TierInfo(Tier.HOST, "CPU", self.ctl.host_capacity(), shared=False)]
        if self.has_file:
            infos.append(TierInfo(Tier.DISK, "STORAGE", 0, shared=True))
        return tuple(infos)

    def share_destinations(self) -> tuple[str, ...]:
        if not self.has_file:
            return ()
        return tuple(sorted(self.peers))

    def actions(self, device_actions: Sequence[ActionSupport]) -> tuple[ActionSupport, ...]:
        mine = {
            Action.DEMOTE: ActionSupport(
                Action.DEMOTE, True, ALL_SELECTORS, supports_range=True,
                notes=(
                    "DEFERRED; completes when every selected G1 block has a valid copy on the target tier "
                    "(host by default" + (", or the shared file tier with target_tier=TIER_DISK" if self.has_file else "")
                    + "): automatic prompt-block offloads are waited for, blocks only in G1 (e.g. decode blocks) "
                    "are copied by the engine; then the G1 copies become the first eviction candidates "
                    "(reclaimed by the next allocation that needs room, reusable until then)"
                ),
            ),
            Action.PREFETCH: ActionSupport(
                Action.PREFETCH, True, ALL_SELECTORS, supports_range=True,
                notes=(
                    "vLLM's OffloadingConnector loads KV into G1 only for a request it admits, so Prefetch "
                    "stages copies in the host tier (G2): file-tier copies are promoted to host memory and host "
                    "copies are refreshed to most-recently-used; the resuming request then loads them from "
                    "host memory. ACCEPTED no-op when everything selected is already on G1"
                ),
            ),
        }
        if self.has_file and self.peers:
            mine[Action.SHARE] = ActionSupport(
                Action.SHARE, True, ALL_SELECTORS, supports_range=True,
                notes=(
                    "destinations are KvHint endpoints of engines that mount the same shared file tier; the "
                    "source writes the selected blocks to that tier, then asks the destination to Prefetch them "
                    "and completes only after the destination's Prefetch SUCCEEDED (data in its host tier)"
                ),
            )
        else:
            mine[Action.SHARE] = ActionSupport(
                Action.SHARE, False,
                notes="Share needs a shared file tier and configured peers (--kvhint-tiers ...,file=DIR,peers=NAME=HOST:PORT)",
            )
        return tuple(mine.get(a.action, a) for a in device_actions)

    # ------------------------------------------------------------ hashes

    def _remember(self, ext: bytes, digest: bytes) -> None:
        d = self._digest
        d[ext] = digest
        d.move_to_end(ext)
        if len(d) > DIGEST_MAP_CAP:
            d.popitem(last=False)

    def _mark_disk(self, ext: bytes) -> None:
        s = self._on_disk
        s[ext] = None
        s.move_to_end(ext)
        if len(s) > DIGEST_MAP_CAP:
            s.popitem(last=False)

    def digest_of(self, ext: bytes, *, aliases: bool = True) -> bytes | None:
        """vLLM block hash (digest) for a wire hash, or None when unknown."""
        if not self.int_hashes:
            return ext
        d = self._digest.get(ext)
        if d is not None:
            return d
        key = self.adapter._key(ext)
        if key is not None:
            return key[:-4]
        if aliases and self.has_file:
            d = self._read_alias(ext)
            if d is not None:
                self._remember(ext, d)
            return d
        return None

    def _alias_path(self, base: str, ext: bytes) -> str:
        h = ext.hex()
        return os.path.join(base, h[:3], h)

    def _read_alias(self, ext: bytes) -> bytes | None:
        for base in self.alias_dirs:
            try:
                with open(self._alias_path(base, ext)) as f:
                    d = bytes.fromhex(f.read().strip())
            except (OSError, ValueError):
                continue
            if self.adapter.external(d) == ext:
                return d
        return None

    def _write_aliases(self, exts: Sequence[bytes], digests: Sequence[bytes]) -> None:
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

    # ------------------------------------------------------------ residency

    def _host_ready(self, d: bytes) -> bool:
        return self.ctl.host_state(d) is HostState.READY

    def _file_has(self, ext: bytes, d: bytes | None) -> bool:
        if not self.has_file:
            return False
        if ext in self._on_disk:
            return True
        if d is not None and self.ctl.file_has(d):
            self._mark_disk(ext)
            return True
        return False

    def _inflight_cascade_keys(self) -> set[Any]:
        jobs = getattr(self.ctl.manager, "_jobs", None)
        if not jobs:
            return set()
        return {k for m in jobs.values() if not m.transfer_job.is_promotion for k in m.transfer_job.keys}

    def _file_settled(self, ext: bytes, d: bytes, inflight: set[Any]) -> bool:
        """A file copy exists and its write job was processed (so its BlockStored
        event precedes anything an operation publishes about it)."""
        if ext in self._on_disk:
            return True
        if not self.has_file or not self.ctl.file_has(d):
            return False
        if any(self.ctl.key(d, g) in inflight for g in self.ctl.group_ids):
            return False
        self._mark_disk(ext)
        return True

    def lower_tiers_of(self, h: bytes) -> int:
        """Tier bitmask of the valid HOST / DISK copies of wire hash `h`."""
        d = self.digest_of(h)
        if d is None:
            return 0
        mask = Tier.HOST.bit if self._host_ready(d) else 0
        if self._file_has(h, d):
            mask |= Tier.DISK.bit
        return mask

    def _mark_demoted(self, exts: Iterable[bytes]) -> None:
        d = self._demoted
        for e in exts:
            d[e] = None
            d.move_to_end(e)
        while len(d) > DIGEST_MAP_CAP:
            d.popitem(last=False)

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

    def residual_tiers(self, h: bytes) -> int:
        """`lower_tiers_of` for the eviction path (a G1 copy of a block no session
        tracks just went): only blocks this runtime saw stored are checked, so an
        evicted decode block costs a dict lookup, not a file-system probe."""
        d = self._digest.get(h) if self.int_hashes else h
        if d is None:
            return 0
        mask = Tier.HOST.bit if self._host_ready(d) else 0
        if self._file_has(h, d):
            mask |= Tier.DISK.bit
        return mask

    def _remaining_tiers(self, h: bytes) -> int:
        mask = self.lower_tiers_of(h)
        if self.adapter._copies(h):
            mask |= Tier.DEVICE.bit
        return mask

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
            self._publish_stored(host, Tier.HOST, "CPU")
        if disk:
            self._publish_stored(disk, Tier.DISK, "STORAGE")

    def _on_manager_events(self, events: list[Any]) -> None:
        external = self.adapter.external
        for ev in events:
            tier_medium = _MEDIUM.get(ev.medium)
            if tier_medium is None:
                continue
            tier, medium = tier_medium
            exts: list[bytes] = []
            for key in ev.keys:
                if get_offload_group_idx(key) != 0:
                    continue
                d = bytes(get_offload_block_hash(key))
                e = external(d)
                exts.append(e)
                if not ev.removed:
                    self._remember(e, d)
                    if tier is Tier.DISK:
                        self._mark_disk(e)
            if not exts:
                continue
            name = ("host_" if tier is Tier.HOST else "disk_") + ("removed" if ev.removed else "stored")
            self.counters[name] = self.counters.get(name, 0) + len(exts)
            if ev.removed:
                if tier is Tier.DISK:
                    for e in exts:
                        self._on_disk.pop(e, None)
                self.core.on_removed(exts, tier=tier, medium=medium, cause=RemovalCause.EVICTED,
                                     remaining_tiers=self._remaining_tiers)
            else:
                self._publish_stored(exts, tier, medium)

    def _publish_stored(self, exts: list[bytes], tier: Tier, medium: str) -> None:
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

    # ------------------------------------------------------------ operations: start

    def needs_steps(self) -> bool:
        return any(op.phase is Phase.COPY for op in self._ops.values())

    def start(self, task: TierTask) -> TierRefusal | None:
        """Engine thread. None when the operation started; otherwise why it
        cannot (the executor answers REJECTED with that reason)."""
        if self._closed:
            return TierRefusal(Reason.SHUTTING_DOWN, "the engine is shutting down")
        if len(self._ops) >= MAX_PENDING_OPS:
            return TierRefusal(Reason.RESOURCE_EXHAUSTED, f"{len(self._ops)} tier operations already in flight (limit {MAX_PENDING_OPS})")
        hint = task.hint
        action = hint.action
        exts = tuple(dict.fromkeys(task.block_hashes))
        maybe = [self.digest_of(h) for h in exts]
        unknown = sum(d is None for d in maybe)
        if unknown:
            return TierRefusal(Reason.NOT_RESIDENT, f"{unknown} of {len(exts)} selected blocks have no known content hash on this engine")
        digests = [d for d in maybe if d is not None]
        cap = self.ctl.host_capacity()
        timeout = self.op_timeout_s
        if action is Action.DEMOTE:
            target = hint.target_tier or Tier.HOST
            if target is Tier.DISK and not self.has_file:
                return TierRefusal(Reason.UNSUPPORTED, "no file tier is configured")
            if len(exts) > cap:
                return TierRefusal(Reason.RESOURCE_EXHAUSTED, f"host tier holds {cap} blocks; Demote selected {len(exts)} (use max_blocks)")
        elif action is Action.PREFETCH:
            target = Tier.HOST
            need = sum(not self.ctl.g1_has(d) for d in digests)
            if need > cap:
                return TierRefusal(Reason.RESOURCE_EXHAUSTED, f"host tier holds {cap} blocks; Prefetch needs to stage {need} (use max_blocks)")
            if hint.deadline_s is not None:
                timeout = hint.deadline_s
        elif action is Action.SHARE:
            target = Tier.DISK
            if not self.has_file:
                return TierRefusal(Reason.UNSUPPORTED, "Share needs a shared file tier")
            address = self.peers.get(hint.destination)
            if address is None:
                return TierRefusal(Reason.UNKNOWN_DESTINATION, f"destination {hint.destination!r} is not a configured peer")
            if len(exts) > cap:
                return TierRefusal(Reason.RESOURCE_EXHAUSTED, f"host tier holds {cap} blocks; Share selected {len(exts)} (use max_blocks)")
        else:
            return TierRefusal(Reason.UNSUPPORTED, f"{action.name} is not a tier action")
        op = TierOp(task.operation_id, action, target, exts, digests, time.monotonic() + timeout)
        if action is Action.SHARE:
            op.destination, op.address = hint.destination, self.peers[hint.destination]
        self._ops[op.op_id] = op
        self.core.operations.running(op.op_id)
        failure = self._progress(op, starting=True)
        if failure is not None:
            del self._ops[op.op_id]
            self._cleanup(op)
            return TierRefusal(Reason.RESOURCE_EXHAUSTED, failure)
        self._kick()
        return None

    def _kick(self) -> None:
        """Make an idle EngineCore re-check has_work() (it may be about to block on
        its input queue right after the idle callback that started this op)."""
        engine = getattr(self.adapter, "_engine_core", None)
        queue = getattr(engine, "input_queue", None)
        if queue is None:
            return
        from vllm.v1.engine import EngineCoreRequestType

        queue.put_nowait((EngineCoreRequestType.WAKEUP, None))

    # ------------------------------------------------------------ operations: progress

    def on_step(self) -> None:
        """Engine thread, every schedule(): progress and complete operations."""
        if not self._ops:
            return
        now = time.monotonic()
        for op in list(self._ops.values()):
            if op.phase is Phase.DONE:
                self._ops.pop(op.op_id, None)
                continue
            if op.phase is Phase.REMOTE:
                if now > op.deadline + 30.0:  # the worker enforces the deadline; this is a backstop
                    self._fail(op, Reason.DEADLINE_EXCEEDED, "destination did not answer in time")
                continue
            if now > op.deadline:
                self._fail(op, Reason.DEADLINE_EXCEEDED, f"{op.action.name} did not complete before its deadline")
                continue
            try:
                failure = self._progress(op)
            except Exception as exc:  # noqa: BLE001
                log.exception("kvhint tiers: operation %s failed", op.op_id)
                self._fail(op, Reason.OPERATION_FAILED, f"{type(exc).__name__}: {exc}")
                continue
            if failure is not None:
                reason, message = failure
                self._fail(op, reason, message)

    def _progress(self, op: TierOp, starting: bool = False) -> Any:
        if op.action is Action.PREFETCH:
            return self._progress_prefetch(op, starting)
        return self._progress_copy(op, starting)

    def _store_missing(self, op: TierOp, missing: list[bytes], starting: bool) -> Any:
        if op.store is not None and not op.store.done:
            return None
        if op.store_tries >= MAX_STORE_RETRIES:
            return Reason.RESOURCE_EXHAUSTED, "host tier keeps evicting the copies (too small for the working set)"
        op.store_tries += 1
        store = self.ctl.force_store(missing)
        op.store = store
        if store.failed:
            msg = f"host tier is full: {store.failed}"
            return msg if starting else (Reason.RESOURCE_EXHAUSTED, msg)
        op.stored_blocks += len(store.hashes)
        if self.has_file:
            op.written_blocks += len(store.hashes)  # complete_store cascades them to the file tier
        return None

    def _progress_copy(self, op: TierOp, starting: bool) -> Any:
        """Demote and Share: every selected block valid on op.target."""
        ctl = self.ctl
        want_file = op.target is Tier.DISK
        missing, lost, not_ready = [], [], 0
        cascade: list[bytes] = []
        inflight = self._inflight_cascade_keys() if want_file else set()
        for e, d in zip(op.exts, op.digests):
            if want_file and self._file_settled(e, d, inflight):
                continue
            st = ctl.host_state(d)
            if st is HostState.READY:
                if want_file:
                    not_ready += 1
                    in_flight = any(ctl.key(d, g) in inflight for g in ctl.group_ids)
                    if d not in op.cascaded and not in_flight and not ctl.file_has(d):
                        cascade.append(d)
                continue
            not_ready += 1
            if st is HostState.PENDING:
                continue
            if ctl.g1_has(d):
                missing.append(d)
            else:
                lost.append(e)
        if lost and not (op.store is not None and not op.store.done):
            msg = f"{len(lost)} of {len(op.exts)} blocks left every tier before a copy was made"
            return msg if starting else (Reason.OPERATION_FAILED, msg)
        if missing:
            # Most-recently-used first, so the host LRU does not make room for the
            # missing copies by evicting this operation's ready ones.
            absent = set(missing)
            ctl.touch_host([d for d in op.digests if d not in absent])
            failure = self._store_missing(op, missing, starting)
            if failure is not None:
                return failure
        if cascade:
            self._force_cascade(cascade)
            op.cascaded.update(cascade)
            op.written_blocks += len(cascade)
        if not_ready or starting:
            return None
        # Every selected block has a valid copy on the target tier.
        bpb = self.bytes_per_block
        if op.action is Action.DEMOTE:
            moved = (op.stored_blocks + op.written_blocks) * bpb
            self.core.on_transfer(list(op.exts), Tier.DEVICE, op.target, moved, op.op_id)
            self._complete(op, {op.target: len(op.exts)}, moved)
            self._mark_demoted(op.exts)
            # Reclamation is a separate, later step: the G1 copies become the first
            # eviction candidates now (tail first), and go when room is needed.
            self.adapter.demote_first(op.exts)
            return None
        # Share: the shared tier holds everything; hand over to the destination.
        written = (op.stored_blocks + op.written_blocks) * bpb
        if written:
            self.core.on_transfer(list(op.exts), Tier.HOST, Tier.DISK, written, op.op_id)
        op.phase = Phase.REMOTE
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvhint-share")
        self._pool.submit(self._share_worker, op, written)
        return None

    def _force_cascade(self, digests: list[bytes]) -> None:
        """Write READY host copies to the file tier(s) now (the cascade the tiering
        manager runs after a store; the chunks are pinned until the write finishes)."""
        mgr = self.ctl.manager
        keys = [self.ctl.key(d, g) for g in self.ctl.group_ids for d in digests]
        ctx = ReqContext(req_id=f"kvhint-cascade-{next(_ids)}")
        for idx, tier in enumerate(mgr.secondary_tiers):
            if tier in self.ctl.file_tiers:
                tier.submit_store(mgr.create_store_job(keys, ctx, idx))

    def _progress_prefetch(self, op: TierOp, starting: bool) -> Any:
        ctl = self.ctl
        if starting:
            to_promote = []
            for e, d in zip(op.exts, op.digests):
                if ctl.g1_has(d) or ctl.host_state(d) is not HostState.ABSENT:
                    continue
                if self._file_has(e, d):
                    to_promote.append(d)
            if to_promote:
                op.prefetch = Prefetch(ctl, to_promote)
            return None
        pf = op.prefetch
        if pf is not None and not pf.closed:
            pf.poll()
            if not pf.closed:
                return None
        if pf is not None:
            op.promoted.extend(pf.hits)
            op.prefetch = None
        staged, waiting, absent = [], 0, []
        for d in op.digests:
            if ctl.g1_has(d):
                continue
            st = ctl.host_state(d)
            if st is HostState.READY:
                staged.append(d)
            elif st is HostState.PENDING:
                waiting += 1
            else:
                absent.append(d)
        # Staged copies first in LRU order: later promotions must not evict them.
        ctl.touch_host(staged)
        if waiting:
            return None
        # A promotion answers MISS when the host tier has no evictable chunk at that
        # moment (chunks pinned by file writes in flight, or just stored by a request
        # that has not finished yet): retry while such work is pending, a few more
        # times otherwise, then fail.
        retry = [d for d in absent if ctl.file_has(d)]
        if retry:
            pending = ctl.manager.has_pending_work()
            if pending or op.store_tries < MAX_STORE_RETRIES:
                if not pending:
                    op.store_tries += 1
                op.prefetch = Prefetch(ctl, retry)
                return None
        lost = len(absent)
        promoted = list(dict.fromkeys(op.promoted))
        moved = len(promoted) * self.bytes_per_block
        if promoted:
            ext_of = {d: e for e, d in zip(op.exts, op.digests)}
            self.core.on_transfer([ext_of[d] for d in promoted], Tier.DISK, Tier.HOST, moved, op.op_id)
        if lost:
            full = ctl.host_used() >= ctl.host_capacity()
            reason = Reason.RESOURCE_EXHAUSTED if full else Reason.OPERATION_FAILED
            why = (f"the host tier is full ({self._host_usage()})" if full
                   else "they are on no lower tier")
            self._complete(op, {Tier.HOST: len(staged)}, moved, ok=False, reason=reason,
                           message=f"{lost} of {len(op.exts)} blocks could not be staged: {why}")
            return None
        self._complete(op, {Tier.HOST: len(staged)}, moved)
        return None

    def _host_usage(self) -> str:
        p = self.ctl.primary
        return (f"{self.ctl.host_used()} of {self.ctl.host_capacity()} chunks in use, "
                f"{getattr(p, '_num_evictable_cache_chunks', '?')} evictable, "
                f"{getattr(p, '_num_write_pending_chunks', '?')} being written; "
                f"{len(getattr(self.ctl.manager, '_jobs', ()))} file transfers in flight")

    # ------------------------------------------------------------ Share: destination side of the handshake

    def _channel(self, address: str) -> Any:
        import grpc

        with self._channels_lock:
            ch = self._channels.get(address)
            if ch is None:
                ch = grpc.insecure_channel(address)
                self._channels[address] = ch
            return ch

    def _share_worker(self, op: TierOp, written: int) -> None:
        """Worker thread: aliases, then the destination's Prefetch; result back to the engine thread."""
        ok, reason, message, remote_bytes, remote_blocks = False, Reason.OPERATION_FAILED, "", 0, 0
        try:
            import grpc

            from kvhint.v1 import kvhint_pb2 as pb
            from kvhint.v1 import kvhint_pb2_grpc as pbg

            if self.int_hashes:
                self._write_aliases(op.exts, op.digests)
            stub = pbg.KvHintServiceStub(self._channel(op.address))
            token = self.core.config.auth_token
            metadata = (("authorization", f"Bearer {token}"),) if token else None

            def remaining() -> float:
                return op.deadline - time.monotonic()

            hint = pb.Hint(
                hint_id=f"kvhint-share-{op.op_id}",
                selector=pb.Selector(block_hashes=pb.BlockHashSelector(block_hashes=list(op.exts))),
                prefetch=pb.PrefetchAction(),
            )
            hint.prefetch.deadline.FromNanoseconds(int(max(remaining(), 0.1) * 1e9))
            resp = stub.ApplyHints(pb.ApplyHintsRequest(hints=[hint]), timeout=max(min(remaining(), 10.0), 0.1),
                                   metadata=metadata)
            r = resp.results[0]
            if r.outcome in (pb.OUTCOME_ACCEPTED, pb.OUTCOME_CLIPPED) and not r.operation_id:
                ok, remote_blocks = True, len(op.exts)  # already on the destination's device tier
            elif r.outcome == pb.OUTCOME_DEFERRED:
                while True:
                    left = remaining()
                    if self._closed:
                        reason, message = Reason.SHUTTING_DOWN, "the engine is shutting down"
                        break
                    if left <= 0:
                        reason, message = Reason.DEADLINE_EXCEEDED, f"destination {op.destination} did not finish in time"
                        break
                    got = stub.GetOperation(pb.GetOperationRequest(operation_id=r.operation_id),
                                            timeout=max(min(left, 5.0), 0.1), metadata=metadata).operation
                    if got.state == pb.Operation.STATE_SUCCEEDED:
                        ok, remote_bytes = True, got.bytes_moved
                        remote_blocks = sum(c.blocks for c in got.blocks) or len(op.exts)
                        break
                    if got.state == pb.Operation.STATE_FAILED:
                        reason = Reason(got.reason) if got.reason in Reason._value2member_map_ else Reason.OPERATION_FAILED
                        message = f"destination {op.destination}: {got.message or 'prefetch failed'}"
                        break
                    time.sleep(min(0.02, max(left, 0)))
            elif r.outcome == pb.OUTCOME_MISSING:
                message = (f"destination {op.destination} cannot see the shared blocks "
                           "(does it mount the same file tier with the same model and block size?)")
            else:
                reason = Reason(r.reason) if r.reason in Reason._value2member_map_ else Reason.OPERATION_FAILED
                if reason not in (Reason.RESOURCE_EXHAUSTED, Reason.UNSUPPORTED, Reason.SHUTTING_DOWN):
                    reason = Reason.OPERATION_FAILED
                message = f"destination {op.destination} rejected the prefetch: {r.message}"
        except Exception as exc:  # noqa: BLE001 - reported on the operation
            code = getattr(exc, "code", None)
            detail = f"{code().name}" if callable(code) else f"{type(exc).__name__}: {exc}"
            reason = Reason.DEADLINE_EXCEEDED if "DEADLINE_EXCEEDED" in detail else Reason.OPERATION_FAILED
            message = f"destination {op.destination} ({op.address}) unreachable: {detail}"
        result = (ok, reason, message, written, remote_bytes, remote_blocks)
        try:
            self.core.submit(lambda: self._finish_share(op, *result))
        except Exception:  # noqa: BLE001 - engine stopped: shutdown() failed the op
            pass

    def _finish_share(self, op: TierOp, ok: bool, reason: Reason, message: str, written: int,
                      remote_bytes: int, remote_blocks: int) -> None:
        if op.phase is Phase.DONE:
            return
        moved = written + remote_bytes
        if ok:
            self.core.on_transfer(list(op.exts), Tier.DISK, Tier.REMOTE, remote_bytes, op.op_id)
            self._complete(op, {Tier.DISK: len(op.exts), Tier.REMOTE: remote_blocks}, moved,
                           message=f"visible on {op.destination}")
        else:
            self._complete(op, {Tier.DISK: len(op.exts)}, moved, ok=False, reason=reason, message=message)

    # ------------------------------------------------------------ completion

    def _complete(self, op: TierOp, blocks: dict[Tier, int], moved: int, *, ok: bool = True,
                  reason: Reason = Reason.UNSPECIFIED, message: str = "") -> None:
        op.phase = Phase.DONE
        self._ops.pop(op.op_id, None)
        self._cleanup(op)
        self.core.operations.complete(op.op_id, ok=ok, reason=reason, message=message,
                                      blocks={t: n for t, n in blocks.items() if n}, bytes_moved=moved)

    def _fail(self, op: TierOp, reason: Reason, message: str) -> None:
        moved = (op.stored_blocks + op.written_blocks) * self.bytes_per_block
        self._complete(op, {}, moved, ok=False, reason=reason, message=message)

    def _cleanup(self, op: TierOp) -> None:
        if op.prefetch is not None:
            op.prefetch.close()  # promotions already submitted finish on their own
        # An injected store in flight releases its G1 pins itself when the copy completes.

    def shutdown(self) -> None:
        """Fail what is pending (SHUTTING_DOWN), stop the share worker, close channels."""
        self._closed = True
        for op in list(self._ops.values()):
            self._complete(op, {}, 0, ok=False, reason=Reason.SHUTTING_DOWN, message="the engine is shutting down")
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        with self._channels_lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()
