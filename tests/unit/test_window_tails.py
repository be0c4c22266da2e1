"""kvhint_server.window_tails against a brute-force reading of the proto's KvCacheGroup contract:
a hit ending at block e needs every sliding-window group's copies of the ceil((window - 1) /
block_size) blocks ending at e. Of the blocks a clip kept, exactly those with a kept hit end after
them on their chain (every block between kept) must stay; the rest protect nothing a resume
reads. Engine-neutral: the fake engine says which groups hold each block."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator

from hypothesis import given, settings
from hypothesis import strategies as st
from kvhint_unit_support import FakeEngine, h, local_engine_info

from kvhint_server import KvHintCore, ServerConfig
from kvhint_server.model import KvCacheGroupInfo, KvCacheGroupKind, Tier
from kvhint_server.window_tails import resumable, window_blocks

BLOCK = 16
FULL = KvCacheGroupInfo(0, KvCacheGroupKind.FULL_ATTENTION, BLOCK)


def window(group_id: int, tokens: int) -> KvCacheGroupInfo:
    return KvCacheGroupInfo(group_id, KvCacheGroupKind.SLIDING_WINDOW, BLOCK, tokens, defines_residency=False)


@contextlib.contextmanager
def engine(*groups: KvCacheGroupInfo) -> Iterator[FakeEngine]:
    """A core over a fake engine whose KV-cache groups are a full-attention one and `groups`."""
    core = KvHintCore(ServerConfig(address="127.0.0.1:0"), monotonic=time.monotonic)
    eng = FakeEngine(core, dataclasses.replace(local_engine_info(num_device_blocks=256), kv_cache_groups=(FULL, *groups)))
    core.attach(eng)
    eng.start()
    try:
        yield eng
    finally:
        eng.stop()


def test_window_blocks_follow_the_contract() -> None:
    info = local_engine_info()
    assert window_blocks(info) == []  # no sliding-window group: nothing to judge
    with_groups = dataclasses.replace(info, kv_cache_groups=(FULL, window(1, 64), window(2, 17), window(3, 16)))
    assert window_blocks(with_groups) == [(2, 4), (4, 1), (8, 1)]
    other = KvCacheGroupInfo(4, KvCacheGroupKind.OTHER, BLOCK)
    assert window_blocks(dataclasses.replace(info, kv_cache_groups=(FULL, window(1, 64), other))) is None
    bigger = dataclasses.replace(window(1, 64), block_size=2 * BLOCK)
    assert window_blocks(dataclasses.replace(info, kv_cache_groups=(FULL, bigger))) is None


chains = st.integers(1, 10).flatmap(
    lambda trunk: st.tuples(
        st.just(trunk),
        st.one_of(st.none(), st.tuples(st.integers(0, trunk - 1), st.integers(1, 6))),  # a branch: after, length
        st.lists(st.sampled_from([16, 17, 20, 33, 40, 64, 65]), min_size=0, max_size=2),  # window tokens per group
        st.randoms(use_true_random=False),
        # The trunk's first block the index knows: a sliding-window model stores only its
        # prompt's tail, so the blocks before it may be untracked (hit ends then go unjudged).
        st.one_of(st.just(0), st.integers(0, trunk - 1)),
    )
)


@settings(max_examples=200, deadline=None)
@given(case=chains)
def test_resumable_keeps_exactly_the_blocks_a_kept_hit_end_follows(case: tuple) -> None:
    """Exactly the contract's blocks when the index knows every block a window reads; with
    untracked ancestors, never fewer (a resume could still read them) and never more than the
    blocks a possible hit end follows: one where every group holds the blocks of its window the
    index knows (an untracked ancestor leaves its group's window unjudged, not the others')."""
    trunk, branch, windows, rnd, known_from = case
    blocks = [h(i) for i in range(trunk)]
    parent = {b: (blocks[i - 1] if i else None) for i, b in enumerate(blocks)}
    position = {b: i for i, b in enumerate(blocks)}
    twig = []
    if branch is not None:
        after, length = branch
        twig = [h(100 + i) for i in range(length)]
        for i, b in enumerate(twig):
            parent[b] = twig[i - 1] if i else blocks[after]
            position[b] = after + 1 + i
    groups = [window(1 + i, w) for i, w in enumerate(windows)]
    held = {b: 1 | sum(1 << g.group_id for g in groups if rnd.random() < 0.6) for b in parent}
    known = set(blocks[known_from:]) | set(twig)
    kept = sorted((b for b in parent if b in known and rnd.random() < 0.8), key=lambda b: position[b])
    with engine(*groups) as eng:
        eng.store(blocks[known_from:], session="s", first_position=known_from, parent=blocks[known_from - 1] if known_from else None)
        if twig:
            eng.store(twig, session="s", first_position=branch[0] + 1, parent=blocks[branch[0]])
        eng.groups_held.update(held)
        got = eng.run(lambda: resumable(eng.core, kept, {b: Tier.DEVICE.bit for b in kept}))

    def path(e: bytes) -> list[bytes]:
        out: list[bytes] = []
        b: bytes | None = e
        while b is not None:
            out.append(b)
            b = parent[b]
        return out

    def hit_end(e: bytes) -> bool:
        chain = path(e)
        return all(all(held[b] & (1 << g.group_id) for b in chain[: -(-(g.sliding_window_tokens - 1) // BLOCK)])
                   for g in groups)

    def possible_end(e: bytes) -> bool:  # every group holds the blocks of its window ending at e the index knows
        chain = path(e)
        return all(all(held[b] & (1 << g.group_id) for b in chain[: -(-(g.sliding_window_tokens - 1) // BLOCK)] if b in known)
                   for g in groups)

    keep = set(kept)

    def followed(b: bytes, is_end) -> bool:
        return any(b in path(e) and set(path(e)[: path(e).index(b) + 1]) <= keep and is_end(e) for e in kept)

    expected = [b for b in kept if followed(b, hit_end)]
    assert set(expected) <= set(got), "dropped a block a resume can read"
    assert set(got) <= {b for b in kept if followed(b, possible_end)}, "kept a block no resume can read"
    assert got == [b for b in kept if b in set(got)], "not in the clip's order"
    if known_from == 0:
        assert got == expected
    if not groups:
        assert got == kept  # a model without sliding-window groups: every kept block stays


def test_an_untracked_ancestor_leaves_only_its_own_groups_window_unjudged() -> None:
    """Two sliding-window groups, a 3-block window (40 tokens) and a 1-block one (16), over a chain
    whose first block the index does not know (a prompt's tail was stored alone). The last kept
    block has no copy in the 1-block window's group, so no resume can end its hit there, whichever
    group comes first; the walk of the 3-block window reached the untracked block first and kept
    it (a clipped Pin spent its budget on a block no resume reads)."""
    blocks = [h(i) for i in range(3)]
    wide, narrow = window(1, 40), window(2, 16)
    for groups in ((wide, narrow), (narrow, wide)):
        with engine(*groups) as eng:
            eng.store(blocks[1:], session="s", first_position=1, parent=blocks[0])
            eng.groups_held.update({blocks[1]: 0b111, blocks[2]: 0b011})  # blocks[2]: no narrow-window copy
            kept = blocks[1:]
            assert eng.run(lambda: resumable(eng.core, kept, {b: Tier.DEVICE.bit for b in kept})) == [blocks[1]]


def test_a_kept_block_only_a_lower_tier_holds_leaves_the_clip_as_it_is() -> None:
    """A Retain also covers blocks only a lower tier holds; their window copies are not judged."""
    blocks = [h(i) for i in range(6)]
    with engine(window(1, 64)) as eng:
        eng.store(blocks, session="lower")
        eng.groups_held.update({b: 1 for b in blocks})  # no window copy on the device
        tiers = {b: Tier.DEVICE.bit for b in blocks} | {blocks[-1]: Tier.HOST.bit}
        assert eng.run(lambda: resumable(eng.core, blocks, tiers)) == blocks
        assert eng.run(lambda: resumable(eng.core, blocks[:-1], tiers)) == []
