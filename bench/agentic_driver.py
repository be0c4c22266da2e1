"""Hints of the agentic benchmark (`bench.agentic_engine`): `HintDriver` feeds the
runtime signals to a policy (`bench.policy`) and sends its actions as kvhint.v1 hints.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from bench.agentic_monitor import Monitor
from bench.policy import (
    Action,
    Demote,
    LibraryPolicy,
    Pin,
    PolicyConfig,
    Prefetch,
    ReferencePolicy,
    Release,
    Retain,
    library_config,
    shared_prefix_target,
)
from bench.trace import Signal, Trace


class HintDriver:
    """Feeds signals to the reference policy and sends its actions as kvhint.v1 hints."""

    def __init__(self, grpc_address: str, trace: Trace, cfg: PolicyConfig | None, ns: Callable[[str], str],
                 scale: float, clock: Callable[[], float], monitor: Monitor | None, library_tiers: bool = False) -> None:
        from kvhint_client import KvHintClient

        self.client = KvHintClient(grpc_address)
        self.policy: ReferencePolicy | LibraryPolicy
        if cfg is None:  # the library policy (runs "policy", "policy+tiers")
            # The engine's answers go back to the library (record), as in a router.
            self.policy = LibraryPolicy(library_config(trace.header, use_tiers=library_tiers), shared_prefix_target(trace.header),
                                        engine_results=True)
        else:
            self.policy = ReferencePolicy(cfg, shared_prefix_target(trace.header))
        self.ns = ns
        self.scale = scale
        self.clock = clock  # trace-clock seconds since the replay started
        self.block_size = trace.header.block_size
        self.lock = threading.Lock()
        self.outcomes: dict[str, dict[str, int]] = {}
        self.errors: list[str] = []
        self.hint_rpcs = 0
        self.hint_rpc_s = 0.0
        # shared-prefix Retain state
        self.prefix_want: tuple[int, float, bool] | None = None  # (priority, deadline on the trace clock, pin?)
        self.prefix_hashes: list[bytes] | None = None
        self.prefix_covered = False
        self.prefix_applications = 0
        self.timers: list[threading.Timer] = []
        self.closed = False
        if monitor is not None:
            monitor.removed_listeners.append(self._on_removed)

    def _on_removed(self, hashes: Iterable[bytes]) -> None:
        if self.prefix_hashes is None:
            return
        ph = set(self.prefix_hashes)
        if any(h in ph for h in hashes):
            self.prefix_covered = False  # its grant went with the block

    def _record(self, action: str, outcome: str) -> None:
        self.outcomes.setdefault(action, {}).setdefault(outcome, 0)
        self.outcomes[action][outcome] += 1

    def _send(self, named: list[tuple[str, Any]]) -> list[Any]:
        if not named:
            return []
        t0 = time.perf_counter()
        try:
            res = self.client.apply(*[h for _, h in named], timeout=30)
        except Exception as err:  # noqa: BLE001 - a failed hint RPC is reported, the replay goes on
            self.errors.append(str(err))
            return []
        finally:
            self.hint_rpcs += 1
            self.hint_rpc_s += time.perf_counter() - t0
        for (name, _), outcome in zip(named, res.outcomes):
            self._record(name, outcome)
        return list(res.results)

    def start(self) -> None:
        with self.lock:
            self._handle(self.policy.start(self.clock()), None)

    def on_signals(self, signals: Sequence[Signal], completed_continuation: str | None, session_id: str | None = None) -> None:
        """A request completed (`completed_continuation`; of `session_id`) and released `signals`.
        The library policy hears of the completion first (an idle pause, unless a signal of the
        same moment replaces it)."""
        with self.lock:
            if session_id is not None and isinstance(self.policy, LibraryPolicy):
                self.policy.completed(session_id, self.clock())
                if not signals:
                    self._handle(self.policy.tick(self.clock()), completed_continuation)
            for sig in signals:
                # stamped with the replay clock (monotonic under the lock)
                self._handle(self.policy.observe(dataclasses.replace(sig, t=self.clock())), completed_continuation)
            if completed_continuation is not None:
                self._maybe_prefix(completed_continuation)

    def on_request(self, session_id: str) -> None:
        """The runtime sends a request of `session_id` (the library policy learns from it)."""
        if isinstance(self.policy, LibraryPolicy):
            with self.lock:
                self._handle(self.policy.request(session_id, self.clock()), None)

    def _handle(self, actions: Sequence[Action], cont: str | None) -> None:
        from kvhint.v1 import kvhint_pb2 as pb
        from kvhint_client import session

        # The library policy's own hints behind `actions` (one each), answered below.
        library = self.policy if isinstance(self.policy, LibraryPolicy) and self.policy.engine_results else None
        originals = library.take_sent() if library is not None else []
        named: list[tuple[str, Any]] = []
        answered: list[Any] = []  # the library hints sent as `named` (same order)
        taken_over: list[Any] = []  # the template's: the driver applies it by block hash (_maybe_prefix)
        for i, a in enumerate(actions):
            sent_before = len(named)
            tgt = a.target
            if tgt.kind == "prefix":
                if isinstance(a, Release):
                    self.prefix_want = None
                    if self.prefix_hashes:
                        from kvhint_client import blocks

                        named.append(("release", blocks(*self.prefix_hashes).release()))
                else:
                    prio = a.priority if isinstance(a, Retain) else 0
                    self.prefix_want = (prio, self.clock() + a.ttl_s, isinstance(a, Pin))
                    self.prefix_covered = False
                continue
            sel = session(self.ns(tgt.id))
            if isinstance(a, Prefetch) and a.delay_s > 0:
                self._later(a.delay_s * self.scale, [("prefetch", sel.prefetch())])
            elif isinstance(a, Prefetch):
                named.append(("prefetch", sel.prefetch()))
            elif isinstance(a, Demote):
                named.append(("demote", sel.demote()))
            elif isinstance(a, Pin):
                named.append(("pin", sel.pin(ttl=a.ttl_s * self.scale, expected_reuse_in=self._scaled(a.expected_reuse_in_s))))
            elif isinstance(a, Retain):
                named.append(("retain", sel.retain(ttl=a.ttl_s * self.scale, priority=a.priority,
                                                   expected_reuse_in=self._scaled(a.expected_reuse_in_s))))
            elif isinstance(a, Release):
                named.append(("release", sel.release()))
            if library is not None:
                (answered if len(named) > sent_before else taken_over).append(originals[i])
        results = self._send(named)
        if library is None:
            return
        if taken_over:
            library.record(taken_over, [pb.HintResult(hint_id=h.hint_id, outcome=pb.OUTCOME_ACCEPTED) for h in taken_over])
        if not answered:
            return
        if len(results) != len(answered):  # the RPC failed: the policy sends them again later
            library.requeue(answered)
            return
        library.record(answered, [self._unscaled(r) for r in results])

    def _unscaled(self, result: Any) -> Any:
        """An engine's result in the trace's time: TTLs were sent scaled by `scale`."""
        if not result.HasField("effective_ttl") or self.scale == 1.0:
            return result
        from kvhint_client.durations import duration_to_seconds

        out = type(result)()
        out.CopyFrom(result)
        out.effective_ttl.FromNanoseconds(int(duration_to_seconds(result.effective_ttl) / self.scale * 1e9))
        return out

    def _scaled(self, seconds: float | None) -> float | None:
        return None if seconds is None else seconds * self.scale

    def _later(self, delay_s: float, named: list[tuple[str, Any]]) -> None:
        """A runtime timer: send `named` after `delay_s` unless the run is over."""

        def fire() -> None:
            with self.lock:
                if not self.closed:
                    self._send(named)

        t = threading.Timer(delay_s, fire)
        t.daemon = True
        self.timers.append(t)
        t.start()

    def _maybe_prefix(self, cont: str) -> None:
        """(Re)apply the shared-prefix Retain by block hash while it is not in full effect."""
        from kvhint_client import blocks, continuation

        want = self.prefix_want
        if want is None or self.prefix_covered or self.policy.shared_prefix is None:
            return
        prio, deadline, pin = want
        remaining = deadline - self.clock()
        if remaining <= 0:
            self.prefix_want = None
            return
        n = (self.policy.shared_prefix.num_tokens or 0) // self.block_size
        if n <= 0:
            return
        if self.prefix_hashes is None:
            try:
                res = self.client.query_residency(continuation(cont).range(0, n), timeout=30)
            except Exception as err:  # noqa: BLE001
                self.errors.append(str(err))
                return
            by_pos = {b.position: b.block_hash for b in res.blocks}
            if not all(p in by_pos for p in range(n)):
                return
            self.prefix_hashes = [by_pos[p] for p in range(n)]
        sel = blocks(*self.prefix_hashes)
        hint = sel.pin(ttl=remaining * self.scale) if pin else sel.retain(ttl=remaining * self.scale, priority=prio)
        results = self._send([("prefix-" + ("pin" if pin else "retain"), hint)])
        self.prefix_applications += 1
        if results:
            affected = sum(c.blocks for c in results[0].affected_blocks)
            self.prefix_covered = affected >= n

    def close(self) -> None:
        with self.lock:
            self.closed = True
        for t in self.timers:
            t.cancel()
        self.client.close()

