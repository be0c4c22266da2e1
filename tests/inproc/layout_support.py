"""vLLM's real scheduler with KvHint over a chosen KV-cache layout (engine_integration.inproc),
for the layout tests (test_hybrid_groups.py, test_window_only.py): build it with vLLM's
`prefix_cache_retention_interval` set, serve one request to completion, apply hints the way
ApplyHints does."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from engine_integration import inproc
from kvhint.v1 import kvhint_pb2 as pb
from kvhint_server.model import HintResult
from kvhint_server.validation import parse_apply_request


@contextlib.contextmanager
def scheduler(
    retention_interval: int | None, *, edit: Callable[[Any], None] | None = None, **kwargs: Any
) -> Iterator[Any]:
    """`inproc.running_scheduler(**kwargs)` whose KV-cache config has vLLM's
    prefix_cache_retention_interval (0, the engine's default: sliding-window blocks are cached
    only as the window tail at each prompt's end; None: every one), then `edit(config)`."""

    def config(cfg: Any) -> None:
        cfg.prefix_cache_retention_interval = retention_interval
        if edit is not None:
            edit(cfg)

    with inproc.running_scheduler(edit_kv_cache_config=config, **kwargs) as s:
        yield s


def run(scheduler: Any, rid: str, prompt: list[int], sid: str | None = None, *, block_size: int, max_tokens: int = 1) -> int:
    """Serve one request to completion; its prefix hit in tokens."""
    scheduler.add_request(inproc.make_request(rid, prompt, session_id=sid, max_tokens=max_tokens, block_size=block_size))
    hit = None
    while inproc.busy(scheduler):
        result = inproc.step(scheduler)
        hit = result.prefix_hits.get(rid, hit)
    assert hit is not None
    return hit


def apply(scheduler: Any, *hints: pb.Hint) -> list[HintResult]:
    """Hints through the ApplyHints path (validation, then the executor in the core's exclusive
    section, which settles deferred bookkeeping first), on the engine thread's state."""
    core = scheduler.kvhint_core
    parsed = parse_apply_request(pb.ApplyHintsRequest(hints=list(hints)), core.config, core.info)
    with core.exclusive():
        return core.executor.apply_batch(parsed).results
