"""Shared helpers for the bench tests: tiny random traces and a brute-force
reference model of vLLM's BlockPool (written from vllm/v1/core/block_pool.py
and kv_cache_utils.py with plain lists, independent of bench.simulate)."""

from __future__ import annotations

from hypothesis import strategies as st

from bench.trace import (
    ChildSpawned,
    Out,
    Request,
    Seg,
    SessionEnded,
    ToolCallStarted,
    Trace,
    TraceHeader,
    sort_events,
)


@st.composite
def tiny_traces(draw, *, block_size: int | None = None, max_requests: int = 14, with_signals: bool = True) -> Trace:
    """Random small traces with shared prefixes, growing sessions, outputs
    fed back into later prompts, forks and a few signals."""
    bs = block_size or draw(st.sampled_from([2, 3, 4]))
    n_req = draw(st.integers(1, max_requests))
    n_sessions = draw(st.integers(1, 4))
    prefix_len = draw(st.integers(0, 3 * bs))
    reqs: list[Request] = []
    sigs: list = []
    context: dict[str, list] = {}
    t = 0.0
    seg_no = 0
    for i in range(n_req):
        sid = f"s{draw(st.integers(0, n_sessions - 1))}"
        t += draw(st.sampled_from([0.1, 0.5, 1.0, 3.0]))
        base = context.get(sid)
        if base is None or draw(st.integers(0, 5)) == 0:
            # fresh start, maybe forking another session's context
            others = [c for k, c in context.items() if k != sid]
            if others and draw(st.booleans()):
                base = list(draw(st.sampled_from(others)))
            else:
                base = [Seg("P", prefix_len)] if prefix_len and draw(st.booleans()) else []
        new_len = draw(st.integers(0 if base else 1, 4 * bs))
        prompt = list(base)
        if new_len:
            prompt.append(Seg(f"n{seg_no}", new_len))
            seg_no += 1
        max_tokens = draw(st.integers(1, 2 * bs + 1))
        rid = f"r{i}"
        reqs.append(
            Request(t, rid, sid, None, rid, i, tuple(prompt), max_tokens, t_done=t + 0.05)
        )
        context[sid] = prompt + [Out(rid, max_tokens)]
        if with_signals:
            kind = draw(st.integers(0, 5))
            ts = t + 0.05
            if kind == 0:
                sigs.append(ToolCallStarted(ts, sid, "short", f"{sid}/{i}"))
            elif kind == 1:
                sigs.append(ToolCallStarted(ts, sid, "long", f"{sid}/{i}"))
            elif kind == 2:
                sigs.append(SessionEnded(ts, sid))
            elif kind == 3:
                sigs.append(ChildSpawned(ts, sid, f"{sid}.c{i}"))
            elif kind == 4:  # a runtime that knows the tool's name but guesses no duration class
                sigs.append(ToolCallStarted(ts, sid, None, f"{sid}/{i}", tool=draw(st.sampled_from(["grep", "pytest"]))))
    max_prompt = max(r.num_prompt_tokens + r.max_tokens for r in reqs)
    max_blocks = -(-max_prompt // bs)
    num_gpu_blocks = draw(st.integers(max_blocks + 1, max_blocks + 12))
    header = TraceHeader(
        block_size=bs,
        num_gpu_blocks=num_gpu_blocks,
        max_model_len=max_prompt + 1,
        duration_classes={"short": 1.0, "long": 10.0},
        shared_prefix={"segment": "P", "tokens": prefix_len, "continuation_id": "P"} if prefix_len else None,
    )
    return Trace(header, sort_events([*reqs, *sigs]))


class ReferencePool:
    """List-based transcription of vLLM's BlockPool for one request at a time."""

    def __init__(self, num_gpu_blocks: int):
        self.ref = [0] * num_gpu_blocks
        self.hash: list[int | None] = [None] * num_gpu_blocks
        self.queue = list(range(num_gpu_blocks))  # FreeKVCacheBlockQueue
        self.queue.pop(0)  # null block = popleft() at construction
        self.cached: dict[int, list[int]] = {}  # BlockHashToBlockMap (insertion-ordered)

    def get_cached_block(self, h: int) -> int | None:
        lst = self.cached.get(h)
        return lst[0] if lst else None

    def touch(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                self.queue.remove(b)
            self.ref[b] += 1

    def get_new_blocks(self, n: int) -> list[int]:
        assert n <= len(self.queue)
        ret, self.queue = self.queue[:n], self.queue[n:]
        for b in ret:
            if self.hash[b] is not None:  # _maybe_evict_cached_block
                self.cached[self.hash[b]].remove(b)
                if not self.cached[self.hash[b]]:
                    del self.cached[self.hash[b]]
                self.hash[b] = None
            self.ref[b] += 1
        return ret

    def cache_full_blocks(self, blocks: list[int], hashes: list[int], num_cached: int, num_full: int) -> None:
        for i in range(num_cached, num_full):
            self.hash[blocks[i]] = hashes[i]
            self.cached.setdefault(hashes[i], []).append(blocks[i])

    def free_blocks(self, ordered: list[int]) -> None:
        first, last = [], []
        for b in ordered:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                (first if self.hash[b] is None else last).append(b)
        self.queue = first + self.queue + last

    def run(self, chain: list[int], num_prompt_tokens: int, max_tokens: int, bs: int) -> int:
        """Scheduler sequence for one request, step by step (prefill, then
        one decode token at a time, sync scheduling). Returns cached tokens."""
        p, o = num_prompt_tokens, max_tokens
        hit: list[int] = []
        for h in chain[: (p - 1) // bs]:
            b = self.get_cached_block(h)
            if b is None:
                break
            hit.append(b)
        self.touch(hit)
        blocks = list(hit)
        num_cached = len(hit)
        computed = len(hit) * bs
        num_tokens = p  # prompt + sampled outputs so far
        # prefill step(s) then decode steps; each step computes the tokens
        # [computed, num_tokens) and caches min(computed+new, num_tokens)
        while True:
            new = num_tokens - computed
            need = -(-(computed + new) // bs)
            blocks += self.get_new_blocks(need - len(blocks))
            num_full = min(computed + new, num_tokens) // bs
            if num_full > num_cached:
                self.cache_full_blocks(blocks, chain, num_cached, num_full)
                num_cached = num_full
            computed += new
            num_tokens += 1  # sample one output token
            if num_tokens - p >= o:
                break
        self.free_blocks(list(reversed(blocks)))
        return len(hit) * bs
