"""HintExecutor: applies validated hints on the engine thread.

A batch runs inside one engine-thread task, so it is applied atomically at a
scheduler step boundary. Every hint gets exactly one HintResult, and every
applied hint is published as a HintApplied event. Hint ids give idempotency:
a re-sent id returns the first result (replayed=True) without re-applying;
the same id with a different hint is REJECTED/HINT_ID_CONFLICT. An id binds
to the hint's content the first time it is seen, valid or not (a rejected
hint's id replays its rejection).

Engine-neutral: selectors resolve through the SessionPrefixIndex (sessions,
continuations) or the adapter (explicit hashes); retention lives in the
RetentionLedger; physical effects go through the EngineAdapter.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

from kvhint.v1 import kvhint_pb2 as pb

from . import resolution, window_tails
from . import wire as wire_format
from .adapter import TierTask
from .errors import excerpt
from .events import HintApplied
from .model import (
    CONTINUATION_OWNER,
    Action,
    Clip,
    HintResult,
    HintSpec,
    Outcome,
    Reason,
    Selector,
    SelectorKind,
    Tier,
    session_owner,
    tiers_of,
)
from .validation import ParsedHint, hint_fingerprint, hint_id_bindable

log = logging.getLogger("kvhint.executor")

if TYPE_CHECKING:
    from .core import KvHintCore
    from .tenant_guard import TenantGuard

_FROM_END = (Action.RELEASE, Action.EVICT, Action.DEMOTE)
# The fewest continuation links kept before the first pruning (HintExecutor._continuation_links).
_LINKS_PRUNE_MIN = 1024


class BatchApplied(NamedTuple):
    results: list[HintResult]
    # Sequence of the last event the batch caused.
    sequence: int
    # The results as pb.HintResult, in request order.
    messages: list[pb.HintResult]


class HintExecutor:
    def __init__(self, core: KvHintCore) -> None:
        self.core = core
        # Hint ids remembered for idempotency, per scope (a tenant's name, "" without tenancy or
        # for an admin): each scope keeps its own idempotency_window most recent ids, so one
        # tenant's traffic cannot push another's ids out of the window.
        self._seen: dict[str, OrderedDict[str, tuple[bytes, HintResult]]] = {}
        # The calling tenant's guard during a batch (tenant_guard.py); None: no tenancy or an admin.
        self._guard: TenantGuard | None = None
        # Continuation -> the sessions the index listed it under when it was granted (Retain or
        # Pin by continuation). The index's bounds may forget a continuation, or its sessions,
        # while its grants live on; a whole session's Release still ends the grants of the
        # continuations it took with it (`_forgotten_continuations`). Entries whose continuation
        # holds no grant any more are dropped lazily (`_prune_links`).
        self._continuation_links: dict[str, set[str]] = {}
        self._prune_links_at = _LINKS_PRUNE_MIN

    # ------------------------------------------------------------ batch

    @property
    def _scope(self) -> str:
        """The tenant whose batch this is ("" without tenancy or for an admin): its hints' events
        and operations are that tenant's alone."""
        return self._guard.tenant.name if self._guard is not None else ""

    def apply_batch(self, parsed: Sequence[ParsedHint], guard: TenantGuard | None = None) -> BatchApplied:
        """Engine thread. Returns the results (request order), the sequence of
        the last event the batch caused, and the results' wire form (made once,
        for the response and the HintApplied events). `guard`: the calling
        tenant's limits (tenant_guard.py)."""
        self._guard = guard
        try:
            return self._apply_batch(parsed)
        finally:
            self._guard = None

    def _apply_batch(self, parsed: Sequence[ParsedHint]) -> BatchApplied:
        results: list[HintResult] = []
        messages: list[pb.HintResult] = []
        for p in parsed:
            # The id binds to the hint's content whether the hint is valid or
            # not (validation.hint_fingerprint), so one rule covers both.
            spec, item, wire = p.spec, p.item, p.wire
            hint_id = item.hint_id if hint_id_bindable(item.hint_id, self.core.config) else ""
            fingerprint = spec.fingerprint if spec is not None else (hint_fingerprint(wire) if hint_id else b"")
            result = self._replay(hint_id, fingerprint)
            if result is not None and result.replayed:
                results.append(result)  # seen before: not again, no new event
                messages.append(wire_format.hint_result(result))
                continue
            if result is None:
                failed = False
                if spec is None:
                    result = item  # type: ignore[assignment]
                else:
                    try:
                        result = self._apply(spec)
                    except Exception as exc:  # noqa: BLE001 - one hint's engine error must not end the batch or the step
                        log.exception("kvhint: applying hint %r (%s) failed", spec.hint_id, spec.action.name)
                        result = HintResult.rejected(
                            spec.hint_id, Reason.OPERATION_FAILED,
                            f"the engine failed applying this hint ({type(exc).__name__}; see the engine log); "
                            "part of it may have taken effect: re-send it, or Release the selector",
                        )
                        failed = True
                if hint_id and not failed:  # a failed hint is not remembered: re-sending it applies it again
                    self._remember(hint_id, fingerprint, result)
            message = wire_format.hint_result(result)
            self.core.bus.publish(HintApplied(wire, result, message, self._scope), sessions=_sessions_of(item, wire))
            results.append(result)
            messages.append(message)
        return BatchApplied(results, self.core.bus.last_sequence, messages)

    def _replay(self, hint_id: str, fingerprint: bytes) -> HintResult | None:
        if not hint_id:
            return None
        seen = self._seen.get(self._scope)
        first_seen = seen.get(hint_id) if seen is not None else None
        if seen is None or first_seen is None:
            return None
        first_fingerprint, first = first_seen
        if first_fingerprint != fingerprint:
            return HintResult.rejected(
                hint_id, Reason.HINT_ID_CONFLICT, f"hint_id {excerpt(hint_id)} was already used for a different hint"
            )
        seen.move_to_end(hint_id)
        return dataclasses.replace(first, replayed=True)

    def _remember(self, hint_id: str, fingerprint: bytes, result: HintResult) -> None:
        seen = self._seen.setdefault(self._scope, OrderedDict())
        seen[hint_id] = (fingerprint, result)
        while len(seen) > self.core.config.idempotency_window:
            seen.popitem(last=False)

    # ------------------------------------------------------------ resolution

    def resolve(self, selector: Selector) -> list[bytes]:
        return resolution.resolve(self.core, selector)

    def tiers_of(self, hashes: Sequence[bytes]) -> dict[bytes, int]:
        return resolution.tiers_of(self.core, hashes)

    def _resident(self, spec: HintSpec, tier: Tier = Tier.DEVICE) -> list[bytes]:
        hashes = self.resolve(spec.selector)
        tiers = self.tiers_of(hashes)
        return [h for h in hashes if tiers.get(h, 0) & tier.bit]

    # ------------------------------------------------------------ actions

    def _apply(self, spec: HintSpec) -> HintResult:
        if self._guard is not None:
            admitted = self._guard.admit(spec)
            if isinstance(admitted, HintResult):
                return admitted
            spec = admitted
        if spec.action in (Action.RETAIN, Action.PIN):
            return self._retain_or_pin(spec)
        if spec.action is Action.RELEASE:
            return self._release(spec)
        if spec.action is Action.EVICT:
            return self._evict(spec)
        return self._tier_action(spec)

    def _cap(self, spec: HintSpec, hashes: list[bytes], clips: list[Clip]) -> list[bytes]:
        if spec.max_blocks and len(hashes) > spec.max_blocks:
            clips.append(Clip.of_blocks(
                Reason.MAX_BLOCKS, f"{len(hashes)} blocks selected, max_blocks={spec.max_blocks}",
                len(hashes), spec.max_blocks,
            ))
            hashes = hashes[-spec.max_blocks :] if spec.action in _FROM_END else hashes[: spec.max_blocks]
        return hashes

    def _selected_on_device(self, spec: HintSpec, clips: list[Clip]) -> list[bytes]:
        """The selector's device-resident blocks, capped by max_blocks."""
        return self._cap(spec, self._resident(spec), clips)

    def _selected_for_grant(self, spec: HintSpec, clips: list[Clip]) -> tuple[list[bytes], dict[bytes, int]]:
        """The blocks a Retain or Pin grants on, capped by max_blocks, with the tiers of the
        copies it protects: a Pin's have a device copy; a Retain's also those only a lower
        tier that honours retention holds (TierInfo.honours_retention)."""
        mask = Tier.DEVICE.bit if spec.action is Action.PIN else self.core.retention_tiers
        hashes = self.resolve(spec.selector)
        tiers = {h: t & mask for h, t in self.tiers_of(hashes).items()}
        return self._cap(spec, [h for h in hashes if tiers.get(h)], clips), tiers

    def _retain_or_pin(self, spec: HintSpec) -> HintResult:
        core = self.core
        clips: list[Clip] = []
        hashes, tiers = self._selected_for_grant(spec, clips)
        if not hashes:
            return self._missing(spec)
        if self._guard is not None:
            hashes = self._guard.clip_budget(spec, hashes, clips)
        assert spec.ttl_s is not None and spec.requested_ttl_s is not None
        if spec.requested_ttl_s > spec.ttl_s:
            clips.append(
                Clip(
                    Reason.TTL_CAPPED,
                    f"ttl {spec.requested_ttl_s:g}s capped to {spec.ttl_s:g}s",
                    requested_ttl_ns=spec.requested_ttl_ns,
                    granted_ttl_s=spec.ttl_s,
                )
            )
        pinned = spec.action is Action.PIN
        ledger = core.ledger
        now = core.monotonic()
        if pinned:
            core.expire_retention()
            new = [h for h in hashes if not ledger.is_pinned(h)]
            headroom = ledger.pin_headroom()
            if len(new) > headroom:
                allowed = set(new[:headroom])
                granted = [h for h in hashes if ledger.is_pinned(h) or h in allowed]
                clips.append(Clip.of_blocks(
                    Reason.PIN_BUDGET, f"pin budget of {ledger.pin_budget_blocks} blocks: pinned {len(granted)} of {len(hashes)}",
                    len(hashes), len(granted),
                ))
                hashes = granted
        hashes = self._resumable(hashes, tiers, clips, clipped=any(c.granted_blocks < c.requested_blocks for c in clips))
        if not hashes:  # a budget left nothing to grant: CLIPPED to 0 blocks (as an Evict of blocks all in use)
            return _result(spec, clips, {})
        ledger.grant(
            spec.selector.owner,
            hashes,
            pinned=pinned,
            priority=spec.priority,
            deadline=now + spec.ttl_s,
            expires_at=core.wall() + spec.ttl_s,
            reuse_at=None if spec.expected_reuse_s is None else now + spec.expected_reuse_s,
        )
        if spec.selector.kind is SelectorKind.CONTINUATION:
            self._link_continuation(spec.selector.continuation_id)
        core.adapter.refile(list(reversed(hashes)))
        return _result(spec, clips, _first_tiers(hashes, tiers), effective_ttl_s=spec.ttl_s)

    def _link_continuation(self, continuation: str) -> None:
        """A grant by `continuation`: remember the sessions the index lists it under now."""
        listed = self.core.index.sessions_listing(continuation)
        if listed:
            self._continuation_links.setdefault(continuation, set()).update(listed)
            if len(self._continuation_links) >= self._prune_links_at:
                self._prune_links()
                self._prune_links_at = max(_LINKS_PRUNE_MIN, 2 * len(self._continuation_links))

    def _prune_links(self) -> None:
        """Forget the links of continuations that hold no grant any more."""
        ledger = self.core.ledger
        for c in [c for c in self._continuation_links if not ledger.owned_by(CONTINUATION_OWNER + c)]:
            del self._continuation_links[c]

    def _forgotten_continuations(self, named: set[str]) -> list[str]:
        """Continuations that hold grants but that the index no longer tracks (its bounds forgot
        them, or their sessions), which were granted while listed under a session of `named`
        and under no session the index still tracks outside it: a Release of `named` is the
        last one a router would send for them (`continuations_leaving_with` covers the
        continuations the index still tracks)."""
        self._prune_links()
        index = self.core.index
        return [c for c, linked in self._continuation_links.items()
                if c not in index.continuations and not linked.isdisjoint(named)
                and all(s in named or s not in index.sessions for s in linked)]

    def _missing(self, spec: HintSpec) -> HintResult:
        """MISSING/NOT_RESIDENT, saying why the selector found nothing to act on: a session or
        continuation the index does not know (a Release forgets a whole session) is named as such,
        so a caller can tell it from one whose blocks are gone."""
        sel, index = spec.selector, self.core.index
        if sel.kind is SelectorKind.SESSION and sel.session_id not in index.sessions:
            return HintResult.missing(spec.hint_id, f"session {excerpt(sel.session_id)} is not in the index: never "
                                      "served here, released, or forgotten by the index's bounds")
        if sel.kind is SelectorKind.CONTINUATION and sel.continuation_id not in index.continuations:
            return HintResult.missing(spec.hint_id, f"continuation {excerpt(sel.continuation_id)} is not in the index: "
                                      "never served here, its session released, or forgotten by the index's bounds")
        return HintResult.missing(spec.hint_id)

    def _resumable(self, hashes: list[bytes], tiers: Mapping[bytes, int], clips: list[Clip], *, clipped: bool) -> list[bytes]:
        """On an engine with sliding-window groups (kvhint_server.window_tails): when a block
        budget `clipped` the chain, drop the kept blocks after the last prefix end a resume can
        hit; with no budget clip, drop them all only when no selected prefix end can be hit (the
        engine holds no window tail a resume of them would read) and no chain goes on past the
        selection (where a hit end would read them too), so that a grant protecting nothing a
        resume reads is not ACCEPTED. Any other unclipped hint keeps every selected block."""
        kept = window_tails.resumable(self.core, hashes, tiers)
        if len(kept) == len(hashes) or (not clipped and (kept or window_tails.continues_beyond(self.core, hashes))):
            return hashes
        taken = "kept" if clipped else "selected"
        clips.append(Clip.of_blocks(
            Reason.WINDOW_TAIL_MISSING,
            f"{len(hashes) - len(kept)} of the {len(hashes)} blocks {taken} come after the last prefix end "
            f"whose sliding-window blocks the engine holds: no resume can hit them",
            len(hashes), len(kept),
        ))
        return kept

    def _release(self, spec: HintSpec) -> HintResult:
        core = self.core
        sel = spec.selector
        index, ledger = core.index, core.ledger
        clips: list[Clip] = []
        sessions = index.session_tree(sel.session_id, sel.include_children) if sel.kind is SelectorKind.SESSION else []
        # A Release narrowed to some blocks (a range, max_blocks, explicit hashes) drops its
        # owners' grants on those; otherwise every grant they hold, also on blocks the selector no
        # longer resolves to (grants may outlive index membership).
        narrowed = sel.has_range or sel.kind is SelectorKind.BLOCK_HASHES or bool(spec.max_blocks)
        owners = [sel.owner]
        if sel.kind is SelectorKind.SESSION:
            owners += [session_owner(s) for s in sessions if session_owner(s) != sel.owner]
            if not narrowed:
                # The whole session ends: so do the grants of the continuations that leave the
                # index with it (no other live session lists them), which no selector could reach after.
                leaving = index.continuations_leaving_with(sessions)
                leaving += self._forgotten_continuations({sel.session_id, *sessions})
                if self._guard is not None:
                    leaving = [c for c in leaving if self._guard.tenant.owns(c)]
                owners += [CONTINUATION_OWNER + c for c in leaving]
        hashes = self.resolve(sel)
        if sel.kind is SelectorKind.BLOCK_HASHES:
            # Explicit hashes select only blocks that are resident somewhere or retained.
            tiers = self.tiers_of(hashes)
            hashes = [h for h in hashes if tiers.get(h, 0) or ledger.owners(h)]
        hashes = self._cap(spec, hashes, clips)
        released: set[bytes] = set()
        for owner in owners:
            released.update(ledger.release(owner, hashes if narrowed else None))
        if not hashes and not released:
            return HintResult.missing(spec.hint_id, "nothing selected and no retention held")
        if released:
            core.adapter.refile(core.tail_first(released))  # a set: each chain's tail first
        # First eviction candidates: blocks nobody else retains or belongs to.
        leaving = set(sessions)
        exclusive = [
            h
            for h in hashes
            if not ledger.owners(h) and set(index.resident_sessions_of(h)) <= leaving
        ]
        moved = core.adapter.demote_first(exclusive)
        if sel.kind is SelectorKind.SESSION and not narrowed:
            for s in sessions:
                index.forget_session(s)
        # Applied to: the blocks whose grants it dropped and the blocks it made first candidates,
        # each once (a grant that outlived its device copy on a lower tier, counted there).
        applied = released.union(moved)
        mask = core.retention_tiers
        tiers = {h: t & mask for h, t in self.tiers_of(list(applied)).items()} if core.lower_retention_tiers else {}
        return _result(spec, clips, _first_tiers(applied, tiers))

    def _evict(self, spec: HintSpec) -> HintResult:
        core = self.core
        clips: list[Clip] = []
        hashes = self._selected_on_device(spec, clips)
        if not hashes:
            return self._missing(spec)
        if self._guard is not None:
            hashes = self._guard.clip_shared(spec, hashes, clips)
        owner = spec.selector.owner
        now = core.monotonic()
        protected = [h for h in hashes if core.ledger.pinned_by_other(h, owner, now)]
        if protected:
            clips.append(Clip.of_blocks(
                Reason.PINNED_BY_OTHER_SESSION, f"{len(protected)} blocks are pinned by another session",
                len(hashes), len(hashes) - len(protected),
            ))
            skip = set(protected)
            hashes = [h for h in hashes if h not in skip]
        # Tail first: evicting a prefix block first would strand its descendants.
        report = core.adapter.evict(list(reversed(hashes)))
        if report.in_use:
            clips.append(Clip.of_blocks(
                Reason.BLOCKS_IN_USE, f"{len(report.in_use)} blocks are in use by running requests",
                len(hashes), len(report.evicted),
            ))
        return _result(spec, clips, {Tier.DEVICE: len(report.evicted)})

    def _tier_action(self, spec: HintSpec) -> HintResult:
        core = self.core
        hashes = self.resolve(spec.selector)
        tiers = self.tiers_of(hashes)
        hashes = [h for h in hashes if tiers.get(h, 0) & _source_tiers(spec)]
        if not hashes:
            return self._missing(spec)
        clips: list[Clip] = []
        hashes = self._cap(spec, hashes, clips)
        if self._guard is not None and spec.action is Action.DEMOTE:
            hashes = self._guard.clip_shared(spec, hashes, clips)
            if not hashes:
                return _result(spec, clips, {})
        if spec.action is Action.PREFETCH and all(tiers[h] & Tier.DEVICE.bit for h in hashes):
            return _result(spec, clips, {Tier.DEVICE: len(hashes)}, message="already resident on the device tier")
        op = core.operations.create(spec.hint_id, spec.action, _sessions_of(spec), spec.destination, self._scope)
        try:
            refusal = core.adapter.start_tier_task(TierTask(op.operation_id, spec, tuple(hashes)))
        except BaseException:
            core.operations.discard(op.operation_id)  # never left PENDING with nothing behind it
            raise
        if refusal is not None:
            core.operations.discard(op.operation_id)
            return HintResult.rejected(spec.hint_id, refusal.reason, refusal.message)
        counts: dict[Tier, int] = {}
        for h in hashes:  # each block counted once, on its nearest tier
            nearest = tiers_of(tiers[h])[0]
            counts[nearest] = counts.get(nearest, 0) + 1
        result = _result(spec, clips, counts)
        result.outcome = Outcome.DEFERRED
        result.reason = Reason.UNSPECIFIED
        result.operation_id = op.operation_id
        return result


def _source_tiers(spec: HintSpec) -> int:
    """Tiers a tier action may start from (bitmask)."""
    lower = Tier.HOST.bit | Tier.DISK.bit | Tier.REMOTE.bit
    if spec.action is Action.DEMOTE:
        # To the host tier: from the device copy; to disk: from either.
        return Tier.DEVICE.bit | (Tier.HOST.bit if spec.target_tier is Tier.DISK else 0)
    return Tier.DEVICE.bit | lower  # Prefetch and Share start from any copy


def _result(
    spec: HintSpec,
    clips: list[Clip],
    affected: dict[Tier, int],
    effective_ttl_s: float | None = None,
    message: str = "",
) -> HintResult:
    outcome = Outcome.CLIPPED if clips else Outcome.ACCEPTED
    return HintResult(
        hint_id=spec.hint_id,
        outcome=outcome,
        reason=clips[0].reason if clips else Reason.UNSPECIFIED,
        message=message or "; ".join(c.detail for c in clips),
        clips=clips,
        affected={t: n for t, n in affected.items() if n},
        effective_ttl_s=effective_ttl_s,
    )


def _first_tiers(hashes: Iterable[bytes], tiers: Mapping[bytes, int]) -> dict[Tier, int]:
    """Blocks per tier, each counted once, on the first tier its mask in `tiers` names."""
    out: dict[Tier, int] = {}
    for h in hashes:
        mask = tiers.get(h, 0)
        tier = next((t for t in Tier if mask & t.bit), Tier.DEVICE)  # Tier order: the device first
        out[tier] = out.get(tier, 0) + 1
    return out


def _sessions_of(item: HintSpec | HintResult, wire: pb.Hint | None = None) -> tuple[str, ...]:
    """The session a hint names (its SessionSelector's), for event filters: also when the
    hint was rejected before it parsed, so a session's own watchers see its hints fail."""
    if isinstance(item, HintSpec):
        return (item.selector.session_id,) if item.selector.kind is SelectorKind.SESSION else ()
    if wire is not None and wire.selector.WhichOneof("target") == "session" and wire.selector.session.session_id:
        return (wire.selector.session.session_id,)
    return ()
