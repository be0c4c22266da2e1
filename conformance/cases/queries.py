"""QueryResidency and ListSessions: what a router reads back."""

from __future__ import annotations

import math
import time

from kvhint.v1 import kvhint_pb2 as pb

from .. import hints as H
from ..model import Registry, check
from ..target import CaseContext
from .outcomes import resident_selection


def register(reg: Registry) -> None:
    @reg.case(
        "queries", "residency-chain-order",
        "QueryResidency MUST report a session's blocks in chain order: positions 0..n-1, prefix_tokens = (position + 1) "
        "* block_size, each block's parent_block_hash the previous block, the device tier, and totals over the selection.",
        needs=("traffic",),
    )
    def chain(ctx: CaseContext) -> None:
        _sel, n, _p, session = resident_selection(ctx, "session", blocks=5)
        page = ctx.stub.QueryResidency(pb.QueryResidencyRequest(selector=H.session_selector(session)), timeout=ctx.timeout)
        blocks = list(page.blocks)
        bs = ctx.plan.block_size
        check([b.position for b in blocks] == list(range(n)), f"positions {[b.position for b in blocks]}")
        check([b.prefix_tokens for b in blocks] == [(i + 1) * bs for i in range(n)], f"prefix_tokens {[b.prefix_tokens for b in blocks]}")
        check(blocks[0].parent_block_hash == b"", "the first block has a parent_block_hash")
        check(all(blocks[i].parent_block_hash == blocks[i - 1].block_hash for i in range(1, n)), "parent_block_hash does not link the chain")
        check(all(pb.TIER_DEVICE in b.tiers for b in blocks), "a block just stored is not on the device tier")
        check(all(session in b.session_ids for b in blocks), "a block does not list the session in session_ids")
        totals = {t.tier: t.blocks for t in page.totals}
        check(totals.get(pb.TIER_DEVICE) == n, f"totals {totals}, expected {n} device blocks")
        check(page.as_of_epoch == ctx.caps.epoch, f"as_of_epoch={page.as_of_epoch!r}, current epoch {ctx.caps.epoch!r}")

    @reg.case(
        "queries", "residency-pagination",
        "QueryResidency pages MUST together cover the whole selection once, in order, with the same totals on every "
        "page and an empty next_page_token only on the last.",
        needs=("traffic",),
    )
    def pages(ctx: CaseContext) -> None:
        _sel, n, _p, session = resident_selection(ctx, "session", blocks=5)
        whole = [b.block_hash for b in ctx.residency(H.session_selector(session))]
        token, seen, count = "", [], 0
        while True:
            page = ctx.stub.QueryResidency(pb.QueryResidencyRequest(selector=H.session_selector(session), page_size=2, page_token=token),
                                           timeout=ctx.timeout)
            count += 1
            check(len(page.blocks) <= 2, f"a page of {len(page.blocks)} blocks for page_size 2")
            check({t.tier: t.blocks for t in page.totals}.get(pb.TIER_DEVICE) == n, "totals differ between pages")
            seen += [b.block_hash for b in page.blocks]
            token = page.next_page_token
            if not token or count > n + 2:
                break
        check(seen == whole, f"pages yield {len(seen)} blocks ({len(set(seen))} distinct), the selection has {len(whole)}")
        pages = math.ceil(n / 2)
        check(count == pages, f"{count} pages of size 2 for {n} blocks, expected {pages}")

    @reg.case(
        "queries", "list-sessions-reports-session",
        "ListSessions MUST list a session with resident blocks, with its device block count and its continuation ids.",
        requires=("selector:continuation",),
        needs=("traffic",),
    )
    def sessions(ctx: CaseContext) -> None:
        _sel, n, _p, session = resident_selection(ctx, "session", blocks=3)
        infos = list(ctx.stub.ListSessions(pb.ListSessionsRequest(session_id_prefix=session), timeout=ctx.timeout).sessions)
        check([i.session_id for i in infos] == [session], f"ListSessions(prefix={session!r}) returned {[i.session_id for i in infos]}")
        blocks = {t.tier: t.blocks for t in infos[0].blocks}
        check(blocks.get(pb.TIER_DEVICE) == n, f"ListSessions reports {blocks} blocks, expected {n} on the device tier")
        check(ctx.cid("s") in infos[0].continuation_ids, f"continuation_ids {list(infos[0].continuation_ids)} lack {ctx.cid('s')!r}")

    @reg.case(
        "queries", "pinned-blocks-reported-pinned",
        "After an ACCEPTED PIN, QueryResidency MUST report every selected block as CLASS_PINNED, expiring after the "
        "granted TTL; after RELEASE, none of them pinned.",
        requires=("pin:session", "release:session"),
        needs=("traffic",),
    )
    def pinned(ctx: CaseContext) -> None:
        sel, n, _p, session = resident_selection(ctx, "session")
        hashes = ctx.device_hashes(sel)
        before = time.time()
        result = ctx.apply_one(H.pin(session, ttl=40))
        check(result.outcome == pb.OUTCOME_ACCEPTED, f"pin: {H.describe(result)}")
        blocks = ctx.residency(H.hashes_selector(hashes))
        classes = [pb.RetentionState.Class.Name(b.retention.retention_class) for b in blocks]
        check(len(blocks) == n and all(c == "CLASS_PINNED" for c in classes), f"after an ACCEPTED pin QueryResidency reports {classes}")
        for b in blocks:
            left = b.retention.expires_at.seconds + b.retention.expires_at.nanos / 1e9 - before
            check(30 < left <= 45, f"a 40s pin expires in {left:.1f}s")
        ctx.apply_one(H.release(session))
        after = [pb.RetentionState.Class.Name(b.retention.retention_class) for b in ctx.residency(H.hashes_selector(hashes))]
        check("CLASS_PINNED" not in after, f"after release QueryResidency reports {after}")
