"""`vllm_private.appended_since` over vLLM's real BlockPool: walked back from the free queue's
tail around `BlockPool.free_blocks`, it finds exactly the freed blocks that are cached, in the
order vLLM freed them (those of them with a grant are what `VllmAdapter.refile_freed` files by
their retention class)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

from engine_integration import vllm_private

POOL = 24


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[int, list[tuple[int, bool, int]]]:
    """(cached blocks already free before the free, [(block index, cached, extra holders)] freed
    in order)."""
    left_free = draw(st.integers(0, 6))  # 0: the queue is empty when vLLM frees
    taken = POOL - 1 - left_free  # the null block is taken at construction
    picks = draw(st.lists(st.integers(0, taken - 1), unique=True, max_size=taken))
    freed = [(i, draw(st.booleans()), draw(st.integers(0, 2))) for i in picks]
    return left_free, freed


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_the_walk_finds_the_freed_cached_blocks_in_freeing_order(scenario: tuple[int, list[tuple[int, bool, int]]]) -> None:
    left_free, freed = scenario
    pool = BlockPool(num_gpu_blocks=POOL, enable_caching=True, hash_block_size=16)
    blocks = pool.get_new_blocks(POOL - 1)
    for n, block in enumerate(blocks):  # every block cached, as after a prefill
        block.set_block_hash(make_block_hash_with_group_id(BlockHash(bytes([n]) * 32), 0), 16)
    # Cached blocks already free (queued) before the free; the walk must stop short of them.
    pool.free_blocks(blocks[:left_free])
    blocks = blocks[left_free:]
    before_free = list(pool.free_block_queue.get_all_free_blocks())
    chosen = []
    for i, cached, holders in freed:
        block = blocks[i]
        if not cached:
            block.reset_hash()
        block.ref_cnt += holders  # still held by other requests: freeing leaves it in use
        chosen.append(block)

    mark = vllm_private.queue_tail(pool)
    pool.free_blocks(chosen)
    found = vllm_private.appended_since(pool, mark)
    # The walk with a filter (VllmAdapter.granted_since passes the grant map and the slice of
    # the key it is keyed by): the same blocks, those only whose key slice is in it.
    among = {key[:1] for key in (b.block_hash for b in chosen[::2]) if key is not None}
    filtered = vllm_private.appended_since(pool, mark, among, slice(0, 1))

    expected = [b for b in chosen if b.ref_cnt == 0 and b.block_hash is not None]
    assert [b for b, _ in found] == expected
    assert all(key == b.block_hash for b, key in found)
    assert filtered == [(b, key) for b, key in found if key[:1] in among]
    # Nothing else moved: what was free before is still queued, ahead of what was just appended.
    queue = pool.free_block_queue.get_all_free_blocks()
    assert set(map(id, before_free)) <= set(map(id, queue))
    assert queue[len(queue) - len(expected):] == expected


def test_a_free_that_queues_nothing_finds_nothing() -> None:
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=16)
    blocks = pool.get_new_blocks(3)
    for block in blocks:
        block.ref_cnt += 1  # shared: freeing once leaves each in use
    mark = vllm_private.queue_tail(pool)
    pool.free_blocks(blocks)
    assert vllm_private.appended_since(pool, mark) == []
