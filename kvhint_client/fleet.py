"""FleetClient: send hints to the engines that hold what they select.

    fleet = FleetClient({"e1": "10.0.0.1:50151", "e2": "10.0.0.2:50151"}, follower=follower)
    out = fleet.apply(session("agent-7").pin(ttl=30))
    out.per_engine["e1"].all_accepted

Routing of each hint (by its selector):
- With a ResidencyIndex (an EventFollower's, or one passed directly; engine names must match the
  endpoint names): a session selector goes to the live engines holding blocks of that session
  (most blocks first); a block-hash selector to the live engines holding any of the hashes.
  Selectors the index cannot resolve (continuations, include_children) and selections the index
  finds nowhere (e.g. a session that holds only retention, or an engine not yet synced) are
  resolved by asking the engines.
- Without an index, or for those selectors: a session selector (without include_children) goes
  to the engines whose ListSessions has that exact session (which includes sessions holding
  only retention); other selectors to the engines whose QueryResidency finds at least one block.
- `broadcast=True` skips routing and sends every hint to every engine.

Data parallelism: an engine started with `--data-parallel-size N` runs N engine cores, each with
its own KV-cache pool and its own KvHint server on port + rank. Treat the ranks as engines:
`FleetClient(data_parallel_endpoints("10.0.0.1:50151"))` (and the same mapping for an
EventFollower) routes each session's hints to the rank that served it.

Each engine receives one ApplyHints batch holding its hints in request order (same hint_id on
every engine, so per-engine retries stay idempotent). Engines that fail (routing or apply) are
reported in `errors`; hints that no engine holds are reported in `unrouted` and sent nowhere.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Optional, TypeVar, Union

import grpc

from kvhint.v1 import kvhint_pb2

from . import _rpc
from .builders import Target
from .client import KvHintClient
from .errors import KvHintError
from .follower import EnginesLike, EventFollower, ResidencyIndex, _named_engines
from .results import ApplyResult

_T = TypeVar("_T")


@dataclass(frozen=True)
class FleetApplyResult:
    """Per-engine outcomes of one FleetClient.apply()."""

    per_engine: dict[str, ApplyResult] = field(default_factory=dict)
    errors: dict[str, KvHintError] = field(default_factory=dict)
    #: hint_id -> engines the hint was sent to.
    routes: dict[str, list[str]] = field(default_factory=dict)
    #: Hints no engine holds (sent nowhere).
    unrouted: list[kvhint_pb2.Hint] = field(default_factory=list)

    @property
    def all_accepted(self) -> bool:
        """No engine failed, every hint went somewhere, and every result is ACCEPTED."""
        return not self.errors and not self.unrouted and all(r.all_accepted for r in self.per_engine.values())

    def results_for(self, hint_id: str) -> dict[str, kvhint_pb2.HintResult]:
        """engine -> result of the hint with this id."""
        out = {}
        for engine, result in self.per_engine.items():
            found = result.result_for(hint_id)
            if found is not None:
                out[engine] = found
        return out


def data_parallel_endpoints(
    address: str, size: Optional[int] = None, *, name: str = "dp", timeout: Optional[float] = 10.0
) -> dict[str, str]:
    """{"dp0": "host:port", "dp1": "host:port+1", ...}: the KvHint servers of a data-parallel engine.

    `address` is rank 0's server (the engine's KVHINT_GRPC_ADDRESS). Without `size`, rank 0's
    GetCapabilities.data_parallel_size says how many ranks there are (0 from an older server:
    one). Every rank's GetCapabilities must name its own rank; KvHintError otherwise (e.g. the
    port range overlaps another engine's)."""
    host, port = address.rsplit(":", 1)
    if size is None:
        with KvHintClient(address) as client:
            size = max(1, client.capabilities(timeout=timeout).data_parallel_size)
    endpoints = {f"{name}{rank}": f"{host}:{int(port) + rank}" for rank in range(size)}
    for rank, rank_address in enumerate(endpoints.values()):
        with KvHintClient(rank_address) as client:
            caps = client.capabilities(timeout=timeout)
        if caps.data_parallel_rank != rank or max(1, caps.data_parallel_size) != size:
            raise KvHintError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"GetCapabilities names rank {caps.data_parallel_rank} of {caps.data_parallel_size}, "
                f"expected rank {rank} of {size}",
                method="GetCapabilities",
                address=rank_address,
            )
    return endpoints


class FleetClient:
    """Typed fan-out over several KvHint servers (blocking; calls run in parallel threads)."""

    def __init__(
        self,
        endpoints: EnginesLike,
        *,
        follower: Optional[Union[EventFollower, ResidencyIndex]] = None,
        max_workers: Optional[int] = None,
    ) -> None:
        self._configs = _named_engines(endpoints)
        self._clients = {name: KvHintClient(cfg) for name, cfg in self._configs.items()}
        self._index = follower.index if isinstance(follower, EventFollower) else follower
        self._pool = ThreadPoolExecutor(max_workers=max_workers or len(self._clients), thread_name_prefix="kvhint-fleet")

    @property
    def engines(self) -> list[str]:
        return list(self._clients)

    def client(self, engine: str) -> KvHintClient:
        return self._clients[engine]

    def _fan_out(
        self, engines: list[str], call: Callable[[str, KvHintClient], _T]
    ) -> tuple[dict[str, _T], dict[str, KvHintError]]:
        """Run call(name, client) for each engine in parallel; KvHintErrors are collected per engine."""
        futures = {engine: self._pool.submit(call, engine, self._clients[engine]) for engine in engines}
        results: dict[str, _T] = {}
        errors: dict[str, KvHintError] = {}
        for engine, future in futures.items():
            try:
                results[engine] = future.result()
            except KvHintError as error:
                errors[engine] = error
        return results, errors

    # -- routing ----------------------------------------------------------------------------------

    def _holds_session(self, client: KvHintClient, session_id: str, timeout: Optional[float]) -> bool:
        tokens = _rpc.PageTokens("ListSessions", client.address)
        while True:
            page = client.list_sessions_page(prefix=session_id, page_token=tokens.token, timeout=timeout)
            for info in page.sessions:
                if info.session_id == session_id:
                    return True
                if info.session_id > session_id:
                    return False  # pages are ordered by session_id
            if not tokens.advance(page.next_page_token):
                return False

    def _ask_engines(self, hint: kvhint_pb2.Hint, timeout: Optional[float]) -> tuple[list[str], dict[str, KvHintError]]:
        selector = hint.selector
        if selector.WhichOneof("target") == "session" and not selector.session.include_children:
            session_id = selector.session.session_id
            held, errors = self._fan_out(self.engines, lambda _, c: self._holds_session(c, session_id, timeout))
        else:
            held, errors = self._fan_out(
                self.engines,
                lambda _, c: bool(c.query_residency_page(selector, page_size=1, timeout=timeout).blocks),
            )
        return [e for e in self.engines if held.get(e)], errors

    def engines_for(self, hint: kvhint_pb2.Hint, *, timeout: Optional[float] = None) -> tuple[list[str], dict[str, KvHintError]]:
        """The engines a hint is routed to, and errors from engines that could not be asked."""
        target = Target.from_selector(hint.selector)
        if self._index is not None:
            found: list[str] = []
            if target.session_id is not None and not target.include_children:
                found = [r.engine for r in self._index.engines_for_session(target.session_id) if r.engine in self._clients]
            elif target.block_hashes:
                holders: set[str] = set()
                for raw in target.block_hashes:
                    holders |= self._index.engines_for_block(raw)
                found = [e for e in self.engines if e in holders]
            if found:
                return found, {}
        return self._ask_engines(hint, timeout)

    # -- apply --------------------------------------------------------------------------------------

    def apply(self, *hints: kvhint_pb2.Hint, broadcast: bool = False, timeout: Optional[float] = None) -> FleetApplyResult:
        """Route each hint (see module doc), then apply one batch per engine, in parallel."""
        prepared = _rpc.prepare_hints(hints)
        batches: dict[str, list[kvhint_pb2.Hint]] = {}
        routes: dict[str, list[str]] = {}
        unrouted: list[kvhint_pb2.Hint] = []
        errors: dict[str, KvHintError] = {}
        for hint in prepared:
            if broadcast:
                engines = self.engines
            else:
                engines, route_errors = self.engines_for(hint, timeout=timeout)
                errors.update(route_errors)
            routes[hint.hint_id] = engines
            if not engines:
                unrouted.append(hint)
            for engine in engines:
                batches.setdefault(engine, []).append(hint)
        order = [e for e in self.engines if e in batches]
        per_engine, apply_errors = self._fan_out(order, lambda name, c: c.apply(*batches[name], timeout=timeout))
        errors.update(apply_errors)
        return FleetApplyResult(per_engine=per_engine, errors=errors, routes=routes, unrouted=unrouted)

    def apply_to(self, engine: str, *hints: kvhint_pb2.Hint, timeout: Optional[float] = None) -> ApplyResult:
        """Apply hints on one named engine."""
        return self._clients[engine].apply(*hints, timeout=timeout)

    # -- lifecycle ----------------------------------------------------------------------------------

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for client in self._clients.values():
            client.close()

    def __enter__(self) -> "FleetClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["FleetApplyResult", "FleetClient", "data_parallel_endpoints"]
