"""Tenant enforcement: what a (non-admin) tenant's hints, queries and event
subscriptions may see and do. The principal comes from tenancy.py; the trust
model is docs/tenancy.md.

Rules (a tenant T; "own" = in T's session namespace, tenancy.Tenant.owns):
  * Hints. A session or continuation selector outside T's namespace is
    REJECTED / PERMISSION_DENIED with zero effect (the namespace is a property
    of the id alone, so the answer reveals nothing about other tenants'
    state); so is a session selector with include_children whose tree
    reaches another tenant's session. A block-hash selector keeps only T's
    blocks (a member session of T's, or a retention grant of T's); the
    others are dropped as if not resident (MISSING when none is left), and
    its Retain/Pin grants are held under T's own owner key ("b:<T>").
  * Blocks shared by content. Evict and Demote skip every selected block that
    another tenant's session is a member of, or that a grant of anyone but T
    protects: CLIPPED / PERMISSION_DENIED. Release only drops T's own grants
    and only demotes blocks no other session or grant holds (executor), so
    it never affects another tenant.
  * Budgets. A Pin may cover at most `pin_budget_blocks` distinct blocks
    pinned by T at once; a Retain or Pin at most `retention_budget_blocks`
    distinct blocks protected by T (pins included). Past a budget the hint
    is CLIPPED: PIN_BUDGET for pins, RESOURCE_EXHAUSTED for retention; the
    blocks granted are the selection's first (prefix-first) new blocks.
  * Hint ids are scoped per tenant: T re-sending another tenant's hint_id is
    a new hint, never a replay or a conflict.
  * Queries. QueryResidency with a foreign session/continuation selector and
    WatchEvents with a foreign session filter are PERMISSION_DENIED
    (ErrorInfo REASON_PERMISSION_DENIED, the field path); QueryResidency
    lists only T's blocks; ListSessions only sessions in T's namespace.
    Session id lists in answers and events (BlockInfo.session_ids, member
    ids, PinBroken.session_ids, coordinates) are cut to T's sessions.
  * Events. T's subscription receives an event only when it is tagged for T
    (events.Event.tenants), which the publisher computes once per event on the
    engine thread (TenantRouter): one of the sessions the event names is T's; a
    removal also when any member of the block at removal time is T's (an event
    names at most 16 members); a PinBroken when a grant of T's (session,
    continuation or block-hash) broke, showing T only its own blocks; a
    HintApplied/OperationCompleted of T's hint alone; AllBlocksCleared always.
    The session-less residency chunk of a snapshot (session "") is left out
    (T's blocks are in T's session chunks).

Costs: checks that ask "whose block is this" walk the block's member set
and grant owners until the answer is known (worst case O(members) for a
prefix shared by many sessions; a removal of a block with more members than an
event names walks them once, on the engine thread); budget use is computed once
per batch that has a Retain/Pin, O(retention grants), and kept up to date with
what each Retain/Pin was granted. TenantGuard runs on the engine thread;
TenantRouter wherever events are published; WatchScope on the server's loop,
O(1) per event it is not sent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import islice
from typing import TYPE_CHECKING

import grpc

from kvhint.v1 import kvhint_pb2 as pb

from . import index as index_module
from . import wire
from .errors import RpcError, excerpt
from .events import AllBlocksCleared, Event, HintApplied, OperationCompleted, Payload, PinBroken
from .model import Action, Clip, HintResult, HintSpec, Reason, Selector, SelectorKind, tiers_of
from .operations import Operation
from .queries import Residency
from .tenancy import Tenant, Tenants

if TYPE_CHECKING:
    from .core import KvHintCore


def permission_denied(message: str, field: str) -> RpcError:
    return RpcError(grpc.StatusCode.PERMISSION_DENIED, Reason.PERMISSION_DENIED, message, field)


def selector_field(selector: Selector) -> tuple[str, str]:
    """(the id a session/continuation selector names, its field path)."""
    if selector.kind is SelectorKind.SESSION:
        return selector.session_id, "selector.session.session_id"
    return selector.continuation_id, "selector.continuation.continuation_id"


# ---------------------------------------------------------------- block ownership (engine thread)


def _owner_is(tenants: Tenants, owner: str, tenant: Tenant) -> bool:
    return tenants.tenant_of_owner(owner) is tenant


def grants_of(tenants: Tenants, tenant: Tenant) -> Callable[[str], bool]:
    """Whether a retention owner key is `tenant`'s: what a tenant's view of retention keeps."""
    return lambda owner: _owner_is(tenants, owner, tenant)


def own_block(core: KvHintCore, tenants: Tenants, tenant: Tenant, h: bytes) -> bool:
    """A member session of `tenant`'s, or a grant of `tenant`'s, is on `h`."""
    node = core.index.node(h)
    if node is not None and any(tenant.owns(s) for s in node.sessions):
        return True
    return any(_owner_is(tenants, o, tenant) for o in core.ledger.owners(h))


def foreign_block(core: KvHintCore, tenants: Tenants, tenant: Tenant, h: bytes) -> bool:
    """A session not `tenant`'s is a member of `h`, or a grant not `tenant`'s protects it."""
    node = core.index.node(h)
    if node is not None and not all(tenant.owns(s) for s in node.sessions):
        return True
    per_block = core.ledger.grants.get(h)
    if not per_block:
        return False
    now = core.monotonic()
    return any(g.deadline > now and not _owner_is(tenants, o, tenant) for o, g in per_block.items())


def budget_use(core: KvHintCore, tenants: Tenants) -> dict[str, tuple[set[bytes], set[bytes]]]:
    """Tenant name -> (blocks it pins, blocks it protects), unexpired grants only."""
    now = core.monotonic()
    out: dict[str, tuple[set[bytes], set[bytes]]] = {
        t.name: (set(), set()) for t in tenants.tenants if not t.admin
    }
    for h, per_block in core.ledger.grants.items():
        for owner, g in per_block.items():
            if g.deadline <= now:
                continue
            t = tenants.tenant_of_owner(owner)
            if t is None:
                continue
            pinned, protected = out[t.name]
            protected.add(h)
            if g.pinned:
                pinned.add(h)
    return out


def usage_rows(core: KvHintCore, tenants: Tenants) -> list[tuple[str, str, int, int | None]]:
    """Engine thread: metrics rows (tenant, "pin"|"retention", used, budget)."""
    use = budget_use(core, tenants)
    rows: list[tuple[str, str, int, int | None]] = []
    for t in tenants.tenants:
        if t.admin:
            continue
        pinned, protected = use[t.name]
        rows.append((t.name, "pin", len(pinned), t.pin_budget_blocks))
        rows.append((t.name, "retention", len(protected), t.retention_budget_blocks))
    return rows


# ---------------------------------------------------------------- hints


class TenantGuard:
    """The executor's view of one non-admin tenant for one ApplyHints batch
    (HintExecutor.apply_batch(..., guard=...)). Engine thread."""

    def __init__(self, core: KvHintCore, tenants: Tenants, tenant: Tenant) -> None:
        self.core = core
        self.tenants = tenants
        self.tenant = tenant
        # (blocks the tenant pins, blocks it protects), counted once per batch and kept up to date.
        self._use: tuple[set[bytes], set[bytes]] | None = None
        # What the last Retain/Pin changed in `_use` before the executor granted it: (its owner,
        # blocks newly protected, blocks newly pinned, blocks a Retain stopped counting as
        # pinned). The engine-wide pin budget may clip a Pin, and a window-tail trim any Retain
        # or Pin, after this guard counted it, so the next Retain/Pin first keeps only what the
        # ledger shows was granted (`_settle_counted`).
        self._counted: tuple[str, list[bytes], list[bytes], list[bytes]] | None = None

    def admit(self, spec: HintSpec) -> HintSpec | HintResult:
        """The spec to apply (block hashes narrowed to the tenant's), or a
        REJECTED/PERMISSION_DENIED result with zero effect."""
        if spec.action not in (Action.RETAIN, Action.PIN):
            # Release, Evict and the tier actions can end grants: the budget use counted for
            # an earlier hint of the batch is recounted for the next Retain or Pin, so a batch
            # applies in order exactly as the same hints sent one batch each.
            self._use = None
        sel = spec.selector
        tenant = self.tenant
        if sel.kind is SelectorKind.BLOCK_HASHES:
            mine = tuple(h for h in sel.block_hashes if own_block(self.core, self.tenants, tenant, h))
            return dataclasses.replace(spec, selector=dataclasses.replace(sel, block_hashes=mine, owner_scope=tenant.name))
        ident, field = selector_field(sel)
        if not tenant.owns(ident):
            return HintResult.rejected(
                spec.hint_id, Reason.PERMISSION_DENIED,
                f"{field} {excerpt(ident)} is outside tenant {tenant.name!r}'s namespace {tenant.session_prefix!r}",
            )
        if sel.kind is SelectorKind.SESSION and sel.include_children:
            foreign = [s for s in self.core.index.session_tree(sel.session_id, True) if not tenant.owns(s)]
            if foreign:
                return HintResult.rejected(
                    spec.hint_id, Reason.PERMISSION_DENIED,
                    f"include_children reaches {len(foreign)} sessions outside tenant {tenant.name!r}'s namespace",
                )
        return spec

    def clip_shared(self, spec: HintSpec, hashes: list[bytes], clips: list[Clip]) -> list[bytes]:
        """Evict/Demote: drop blocks another tenant shares or protects (CLIPPED)."""
        keep = [h for h in hashes if not foreign_block(self.core, self.tenants, self.tenant, h)]
        if len(keep) < len(hashes):
            clips.append(Clip.of_blocks(
                Reason.PERMISSION_DENIED, f"{len(hashes) - len(keep)} blocks are shared with or protected by another tenant",
                len(hashes), len(keep),
            ))
        return keep

    def clip_budget(self, spec: HintSpec, hashes: list[bytes], clips: list[Clip]) -> list[bytes]:
        """Retain/Pin: hold the tenant to its pin and retention budgets."""
        tenant = self.tenant
        if tenant.pin_budget_blocks is None and tenant.retention_budget_blocks is None:
            return hashes
        if self._use is None:
            self.core.expire_retention()
            self._use = budget_use(self.core, self.tenants)[tenant.name]
            self._counted = None
        elif self._counted is not None:
            self._settle_counted()
        pinned, protected = self._use
        requested = len(hashes)
        budgets = []
        if spec.action is Action.PIN and tenant.pin_budget_blocks is not None:
            budgets.append((pinned, tenant.pin_budget_blocks, Reason.PIN_BUDGET, "pin", "pinned"))
        if tenant.retention_budget_blocks is not None:
            budgets.append((protected, tenant.retention_budget_blocks, Reason.RESOURCE_EXHAUSTED, "retention", "protected"))
        for used, budget, reason, name, verb in budgets:
            before = len(hashes)
            hashes = self._within(hashes, used, budget)
            if len(hashes) < before:
                clips.append(Clip.of_blocks(reason, f"tenant {tenant.name!r} {name} budget of {budget} blocks: "
                                                    f"{verb} {len(hashes)} of {requested}", requested, len(hashes)))
        unpinned: list[bytes] = []
        self._counted = (
            spec.selector.owner,
            [h for h in hashes if h not in protected],
            [h for h in hashes if h not in pinned] if spec.action is Action.PIN else [],
            unpinned,
        )
        protected.update(hashes)
        if spec.action is Action.PIN:
            pinned.update(hashes)
        elif pinned:
            # A Retain replaces its owner's own Pin of a block (one grant per owner and block):
            # the block stops counting as pinned unless another of the tenant's owners pins it.
            owner, grants, now = spec.selector.owner, self.core.ledger.grants, self.core.monotonic()
            of_tenant = self.tenants.tenant_of_owner
            for h in hashes:
                if h in pinned and not any(
                    g.pinned and g.deadline > now and o != owner and of_tenant(o) is tenant
                    for o, g in grants.get(h, {}).items()
                ):
                    pinned.discard(h)
                    unpinned.append(h)
        return hashes

    def _settle_counted(self) -> None:
        """Uncount what the last Retain/Pin added to the tenant's use but was not granted (the
        engine-wide pin budget clipped the Pin after `clip_budget`, a window-tail trim dropped
        blocks, or the hint failed): the blocks it newly counted held no grant of the tenant's
        before, so each counts now iff the hint's owner holds (a pin on) it. A block a Retain
        stopped counting as pinned counts again when the Retain was not granted on it (the
        owner's Pin is still there)."""
        assert self._use is not None and self._counted is not None
        (owner, new_protected, new_pinned, unpinned), self._counted = self._counted, None
        pinned, protected = self._use
        grants = self.core.ledger.grants
        for h in new_protected:
            if owner not in grants.get(h, ()):
                protected.discard(h)
        for h in new_pinned:
            g = grants.get(h, {}).get(owner)
            if g is None or not g.pinned:
                pinned.discard(h)
        for h in unpinned:
            g = grants.get(h, {}).get(owner)
            if g is not None and g.pinned:
                pinned.add(h)

    @staticmethod
    def _within(hashes: list[bytes], held: set[bytes], budget: int) -> list[bytes]:
        headroom = max(0, budget - len(held))
        new = [h for h in hashes if h not in held]
        if len(new) <= headroom:
            return hashes
        allowed = set(new[:headroom])
        return [h for h in hashes if h in held or h in allowed]


# ---------------------------------------------------------------- queries


def check_query_selector(tenant: Tenant | None, selector: Selector) -> None:
    """PERMISSION_DENIED for a foreign session/continuation selector (any thread)."""
    if tenant is None or tenant.admin or selector.kind is SelectorKind.BLOCK_HASHES:
        return
    ident, field = selector_field(selector)
    if not tenant.owns(ident):
        raise permission_denied(
            f"{excerpt(ident)} is outside tenant {tenant.name!r}'s namespace {tenant.session_prefix!r}", field
        )


def scope_residency(core: KvHintCore, tenants: Tenants, tenant: Tenant, residency: Residency) -> Residency:
    """Engine thread: only the tenant's blocks, with only its session ids and the protection
    its own grants give them (another tenant's pin on a shared block is not shown). A block
    whose reported members reach the cap (index.MAX_MEMBERS_REPORTED) may have more: its
    session ids are then up to that many of the tenant's own members (O(members), as
    `own_block`), not the cut of a cap that other tenants' sessions may fill."""
    views = []
    totals: dict = {}
    now = core.monotonic()
    mine = grants_of(tenants, tenant)
    cap = index_module.MAX_MEMBERS_REPORTED
    for v in residency.blocks:
        if not own_block(core, tenants, tenant, v.block_hash):
            continue
        sessions = tuple(s for s in v.sessions if tenant.owns(s))
        if len(v.sessions) >= cap and (node := core.index.node(v.block_hash)) is not None:
            sessions = tuple(sorted(islice((s for s in node.sessions if tenant.owns(s)), cap)))
        views.append(dataclasses.replace(v, sessions=sessions, retention=core.ledger.view_of(v.block_hash, now, mine)))
    wanted = 0
    for t in residency.totals:
        wanted |= t.bit
    for v in views:
        for t in tiers_of(v.tiers):
            if t.bit & wanted:
                totals[t] = totals.get(t, 0) + 1
    return Residency(views, totals, residency.sequence)


def narrow_prefix(tenant: Tenant | None, prefix: str) -> str | None:
    """ListSessions: the prefix to list under (None: nothing of the tenant's matches)."""
    if tenant is None or tenant.admin or prefix.startswith(tenant.session_prefix):
        return prefix
    if tenant.session_prefix.startswith(prefix):
        return tenant.session_prefix
    return None


# ---------------------------------------------------------------- events


def owns_operation(tenant: Tenant, op: Operation) -> bool:
    """Whether `tenant` may read operation `op` (GetOperation) and get its OperationCompleted: it
    sent the hint that started it, or (an admin's operation) every session it names is the
    tenant's. An operation that names no session (a continuation or block-hash selector) is
    the sender's alone."""
    if op.scope:
        return op.scope == tenant.name
    return bool(op.sessions) and all(tenant.owns(s) for s in op.sessions)


class TenantRouter:
    """Which tenants' subscriptions may receive an event: its tag (events.Event.tenants),
    computed once per event where it is published (the engine thread, or wherever the
    journal books residency), never per subscription. The tenants file is immutable, so any
    thread may ask.

    A tenant gets an event when one of the sessions it names is the tenant's; a HintApplied
    of a tenant's hint, and an OperationCompleted of an operation a tenant's hint started,
    only that tenant (`owns_operation`); AllBlocksCleared every tenant. The core tags what
    sessions alone cannot tell (KvHintCore._removal_tenants, _tenants_of_blocks,
    on_pin_broken): a removal with the tenants of every member of the block and those shown it
    resident that hold it no more, a new copy with the tenants of every member of its blocks,
    a PinBroken with the tenants whose grants broke (`pin_broken`)."""

    def __init__(self, tenants: Tenants) -> None:
        self._tenants = tenants
        self._everyone = frozenset(t.name for t in tenants.tenants if not t.admin)
        self._of_owner = tenants.tenant_of_owner

    def __call__(self, payload: Payload, sessions: Sequence[str]) -> frozenset[str]:
        kind = payload.__class__
        if kind is HintApplied and payload.scope:  # type: ignore[union-attr]
            return frozenset((payload.scope,))  # type: ignore[union-attr]
        if kind is OperationCompleted:
            op: Operation = payload.operation  # type: ignore[union-attr]
            if op.scope:
                return frozenset((op.scope,))
            names = {self.tenant_of(s) for s in op.sessions}  # every session one tenant's
            return frozenset(names) if len(names) == 1 and None not in names else frozenset()
        if kind is AllBlocksCleared:
            return self._everyone  # names no session; every follower must drop the tier
        return self.tenants_of(sessions)

    def tenant_of(self, ident: str) -> str | None:
        """The name of the (non-admin) tenant whose namespace holds a session/continuation id."""
        tenant = self._tenants.tenant_of_id(ident)
        return None if tenant is None else tenant.name

    def tenants_of(self, ids: Iterable[str]) -> frozenset[str]:
        """The tenants whose namespaces hold any of `ids` (the walk stops once every tenant is found)."""
        found: set[str] = set()
        everyone = len(self._everyone)
        for ident in ids:
            name = self.tenant_of(ident)
            if name is not None:
                found.add(name)
                if len(found) == everyone:
                    break
        return frozenset(found)

    def absent(self, tenants: frozenset[str], ids: Iterable[str]) -> frozenset[str]:
        """Those of `tenants` that none of `ids` belongs to (the walk stops once all are found)."""
        left = set(tenants)
        for ident in ids:
            name = self.tenant_of(ident)
            if name in left:
                left.discard(name)
                if not left:
                    break
        return tenants if len(left) == len(tenants) else frozenset(left)

    def pin_broken(
        self, hashes: Sequence[bytes], owners: Mapping[bytes, Sequence[str]]
    ) -> tuple[tuple[str, tuple[bytes, ...]], ...]:
        """(tenant, its blocks) for each tenant whose grant on one of `hashes` ended (`owners`:
        block -> owner keys of its ended grants), blocks in `hashes` order (PinBroken.tenant_blocks)."""
        per: dict[str, list[bytes]] = {}
        of_owner = self._of_owner
        for h in hashes:
            for owner in owners.get(h, ()):
                t = of_owner(owner)
                if t is None:
                    continue
                mine = per.setdefault(t.name, [])
                if not mine or mine[-1] != h:
                    mine.append(h)
        return tuple((name, tuple(blocks)) for name, blocks in per.items())


class WatchScope:
    """One tenant's view of the event stream (one subscription; the server's loop).

    An event passes when its tag (events.Event.tenants, set once when published: see
    TenantRouter) names the tenant; an untagged event (a bus without a router) passes
    nobody's. Nothing is remembered per subscription, so a stream resumed with
    START_RESUME selects exactly as the stream it continues: the removal of a block the
    tenant's follower holds reaches it, wherever the (at most 16) members the event names
    are."""

    def __init__(self, tenant: Tenant, tenants: Tenants) -> None:
        self.tenant = tenant
        # Retention owner keys that are the tenant's (its snapshot shows only those grants).
        self.owned = grants_of(tenants, tenant)

    def check_filter(self, session_ids: Iterable[str]) -> None:
        for i, s in enumerate(session_ids):
            if not self.tenant.owns(s):
                raise permission_denied(
                    f"{excerpt(s)} is outside tenant {self.tenant.name!r}'s namespace", f"filter.session_ids[{i}]"
                )

    def visible(self, events: Sequence[Event]) -> list[Event]:
        """The events tagged for this tenant, in order (one set lookup each)."""
        name = self.tenant.name
        return [ev for ev in events if ev.tenants is not None and name in ev.tenants]

    def event_bytes(self, ev: Event, epoch: str) -> bytes:
        """The event as this tenant may see it: foreign session ids cut out, a PinBroken's
        blocks cut to the tenant's own. A cut view is built once per tenant and event."""
        name = self.tenant.name
        views = ev.views
        if views is not None and name in views:
            return views[name]
        shared = wire.event_bytes(ev, epoch)
        owns = self.tenant.owns
        p = ev.payload
        coords = getattr(p, "coordinates", None)
        if (
            all(owns(s) for s in ev.sessions)
            and (coords is None or not coords.continuation_id or owns(coords.continuation_id))
            and (p.__class__ is not PinBroken or p.tenant_blocks == ((name, p.block_hashes),))  # type: ignore[union-attr]
        ):
            return shared
        msg = pb.WatchEventsResponse.FromString(shared)
        which = msg.WhichOneof("payload")
        body = getattr(msg, which) if which else None
        if body is not None and body.DESCRIPTOR.fields_by_name.get("coordinates") is not None:
            c = body.coordinates
            if c.session_id and not owns(c.session_id):
                c.session_id = ""
            if c.continuation_id and not owns(c.continuation_id):
                c.continuation_id = ""
            _cut(c.member_session_ids, owns)
        if which == "pin_broken":
            _cut(msg.pin_broken.session_ids, owns)
            del msg.pin_broken.block_hashes[:]
            msg.pin_broken.block_hashes.extend(dict(p.tenant_blocks).get(name, ()))  # type: ignore[union-attr]
        view = msg.SerializeToString()
        if views is None:
            views = ev.views = {}
        views[name] = view
        return view

    def cut_blocks(self, blocks: Sequence[pb.BlockInfo]) -> None:
        """A snapshot chunk's blocks as this tenant may see them: foreign session ids cut."""
        for b in blocks:
            _cut(b.session_ids, self.tenant.owns)


def _cut(ids, owns) -> None:  # type: ignore[no-untyped-def]
    keep = [s for s in ids if owns(s)]
    if len(keep) != len(ids):
        del ids[:]
        ids.extend(keep)
