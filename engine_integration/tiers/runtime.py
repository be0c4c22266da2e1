"""TierRuntime: Demote / Prefetch / Share on vLLM's OffloadingConnector, inside EngineCore.

The facade the adapter calls. The KvHint executor resolves a tier hint to
block hashes and calls `VllmAdapter.start_tier_task`, which lands in
`TierRuntime.start` on the engine thread; work then progresses in `on_step()`
(called by `KvHintScheduler.schedule()` every step). The parts:

  settings.TierSettings      peers and operation timeout, validated once
  hashes.HashBook            wire hash <-> vLLM digest maps, alias files
  feed.ResidencyFeed         host / file residency into the index (the
                             connector manager's events), lower-tier lookups
  operations.TierOperations  the Demote / Prefetch / Share state machine
  share.SharePeers           the Share handshake with the destination engine
  host_retention.HostRetention  the host tier's eviction order from the hints
                             (host_policy.KvHintHostPolicy asks it)
  ../vllm_private            every vLLM internal touched (wrapped methods,
                             EngineCore hooks, the manager's transfer jobs)

Capabilities (`tier_infos`, `actions`, `share_destinations`) and the
teardown at shutdown live here.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Sequence
from typing import Any

from kvhint_server.adapter import TierRefusal, TierTask
from kvhint_server.model import Action, ActionSupport, Reason, RemovalCause, SelectorKind, Tier, TierInfo

from .. import vllm_private
from .control import TierControl
from .feed import ResidencyFeed
from .hashes import HashBook
from .host_retention import HostRetention
from .operations import Failure, TierOperations
from .settings import TierSettings

log = logging.getLogger("kvhint.tiers")

ALL_SELECTORS = (SelectorKind.SESSION, SelectorKind.CONTINUATION, SelectorKind.BLOCK_HASHES)


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
        self.adapter = adapter
        self.core = adapter.core
        self.ctl = ctl
        ctl.runtime = self
        ctl.use_groups(adapter.groups.residency)  # tier presence as device residency: full-attention copies
        kvt = scheduler.vllm_config.kv_transfer_config
        self.settings = TierSettings.from_sources(getattr(kvt, "kv_connector_extra_config", None))
        self.peers = self.settings.peers
        self.has_file = bool(ctl.file_tiers)
        self.book = HashBook(
            int_hashes=bool(getattr(adapter, "_int_hashes", False)),
            external=adapter.external,
            device_digest=adapter.device_digest,
            file_tier_paths=[t.file_mapper.base_path for t in ctl.file_tiers],
        )
        self.feed = ResidencyFeed(self.core, ctl, self.book, external=adapter.external,
                                  on_device=lambda h: bool(adapter.device_copies(h)))
        engine = getattr(adapter, "_engine_core", None)
        self.ops = TierOperations(
            self.core, ctl, self.book, self.feed, self.settings,
            bytes_per_block=self._bytes_per_block(scheduler),
            demote_first=adapter.demote_first,
            wake=lambda: vllm_private.wake_engine(engine),
        )
        ctl.install()
        self.host_retention = HostRetention.attach(ctl.primary, adapter)
        self._tap_manager_events(scheduler)
        vllm_private.after_reset_cache(ctl.manager, self._after_reset)
        self._manager_down = vllm_private.shutdown_once(ctl.manager)
        vllm_private.on_busy_loop_exit(engine, self.teardown)
        log.info(
            "kvhint tiers: host %d blocks%s, %d B/block, share peers %s",
            ctl.host_capacity(), ", file tier " + ", ".join(self.book.alias_dirs) if self.has_file else "",
            self.ops.bytes_per_block, sorted(self.peers) or "none",
        )

    @property
    def counters(self) -> dict[str, int]:
        return self.feed.counters

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
        kv_events = getattr(scheduler.vllm_config, "kv_events_config", None)
        forward = bool(kv_events is not None and kv_events.enable_kv_cache_events)
        if self.ctl.primary.events is None:
            self.ctl.primary.events = []
        for tier in self.ctl.file_tiers:
            if getattr(tier, "events", None) is None:
                tier.events = []

        def tap(events: list[Any]) -> None:
            try:
                self.feed.on_manager_events(events)
            except Exception:  # noqa: BLE001 - never break the engine step
                log.exception("kvhint tiers: residency feed failed")

        vllm_private.tap_take_events(self.ctl.manager, tap, forward=forward)

    def _after_reset(self) -> None:
        # An injected store still in flight was prepared on the manager before the reset: its
        # completion only unpins its device blocks (TierControl.drop_in_flight_stores).
        self.ctl.drop_in_flight_stores()
        self.ops.fail_copying(Failure(Reason.OPERATION_FAILED, "the KV connector cache was reset"))
        self.core.on_cleared(Tier.HOST)

    def before_device_reset(self) -> None:
        """Engine thread, before `Scheduler.reset_prefix_cache(reset_running_requests=True)`
        (KvHintScheduler): vLLM preempts its running requests so that no device block is in use,
        and the reset raises if one still is. A Demote's store in flight holds its device blocks
        until the copy ran (TierControl.force_store): they are given back, and the operations
        fail (OPERATION_FAILED)."""
        released = self.ctl.release_device_holds("the device prefix cache was reset during the copy")
        if released:
            log.info("kvhint tiers: device prefix cache reset with %d injected stores in flight; "
                     "their operations fail", len(released))
            self.ops.fail_storing(released, Failure(
                Reason.OPERATION_FAILED,
                "the device prefix cache was reset (pause or sleep) while the copy to the host tier was in flight"))

    def teardown(self) -> None:
        """Engine thread, once, at shutdown: `shutdown()`, then the connector
        manager's own shutdown (file-tier writes drained; ephemeral tiers deleted).

        `vllm serve` on SIGTERM: EngineCore resets SIGTERM to the default action
        and the API server's process manager sends it another SIGTERM at once, so
        `Scheduler.shutdown` (after the executor's) rarely runs. The teardown
        therefore runs at the busy loop's exit with SIGTERM ignored for its
        duration; the parent's `--shutdown-timeout` (the launcher sets one with
        --kvhint-tiers) bounds it with SIGKILL.
        """
        if self._manager_down():
            return
        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            self.shutdown()
            self.ctl.manager.shutdown()
            self.book.remove_alias_tmp()
        except Exception:  # noqa: BLE001 - best effort at exit
            log.exception("kvhint tiers: teardown failed")
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    # ------------------------------------------------------------ capabilities

    def tier_infos(self) -> tuple[TierInfo, ...]:
        infos = [TierInfo(Tier.HOST, "CPU", self.ctl.host_capacity(), shared=False,
                          honours_retention=self.host_retention is not None)]
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

    # ------------------------------------------------------------ used by the adapter (engine thread)

    def lower_tiers_of(self, h: bytes) -> int:
        return self.feed.lower_tiers_of(h)

    def residual_tiers(self, h: bytes) -> int:
        return self.feed.residual_tiers(h)

    def held_for_retention(self, h: bytes) -> int:
        """Tier bitmask of the lower-tier copies of wire hash `h` whose eviction Retain orders
        (the host tier's, when its policy is KvHintHostPolicy; KvHintCore.end_device_grants):
        a dict lookup, no file-system probe."""
        if self.host_retention is None:
            return 0
        d = self.book.known_digest(h)
        return Tier.HOST.bit if d is not None and self.feed.host_ready(d) else 0

    def reconcile(self, exts: Sequence[bytes]) -> None:
        self.feed.reconcile(exts)

    def split_removed(self, exts: list[bytes], cause: RemovalCause) -> list[tuple[list[bytes], RemovalCause]]:
        return self.book.split_removed(exts, cause)

    def needs_steps(self) -> bool:
        return self.ops.needs_steps()

    def start(self, task: TierTask) -> TierRefusal | None:
        return self.ops.start(task)

    def on_step(self) -> None:
        self.ops.on_step()

    def shutdown(self) -> None:
        """Fail what is pending (SHUTTING_DOWN), stop the share worker, close channels."""
        self.ops.shutdown()

