"""TTFT calibration of an idle engine (miss vs hit per prompt length) for `bench.agentic_engine`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from bench.agentic_served import EngineHandle
from bench.runs import linear_fit
from bench.trace import Trace


def calibrate_ttft(engine: EngineHandle, lengths: Sequence[int], *, repeats: int = 5, seed: int = 99) -> dict[str, Any]:
    """TTFT of a cold (miss) and an immediately repeated (hit) prompt per length,
    one request at a time on an idle engine: the prefill share of miss TTFT is
    (miss - hit) / miss. Uses max_tokens=1 and no session. Each value is the
    minimum over `repeats` fresh prompts: on a shared machine other processes
    only ever add time, so the minimum is the uncontended estimate (every
    sample is kept in ``samples_ms``)."""
    import random

    from kvhint_client.openai_traffic import complete

    rng = random.Random(seed)
    rows = []
    for L in lengths:
        miss, hit = [], []
        for _ in range(repeats):
            p = [rng.randint(3, 4000) for _ in range(L)]
            a = complete(engine.http_url, p, max_tokens=1)
            b = complete(engine.http_url, p, max_tokens=1)
            miss.append(a.ttft_s * 1000)
            hit.append(b.ttft_s * 1000)
        m, h = min(miss), min(hit)
        rows.append({"prompt_tokens": L, "miss_ttft_ms": round(m, 1), "hit_ttft_ms": round(h, 1),
                     "prefill_share": round((m - h) / m, 3) if m > 0 else math.nan,
                     "samples_ms": {"miss": [round(x, 1) for x in miss], "hit": [round(x, 1) for x in hit]}})
    # miss TTFT ~ a + b * tokens (least squares)
    xs = [r["prompt_tokens"] for r in rows]
    ys = [r["miss_ttft_ms"] for r in rows]
    fit = linear_fit(xs, ys)
    return {"rows": rows, "statistic": f"min of {repeats}",
            "miss_fit_ms": {"intercept": round(fit[0], 2), "per_1k_tokens": round(fit[1] * 1000, 2)}}


def calibration_lengths(trace: Trace) -> list[int]:
    cap = trace.header.max_model_len - 8
    return [L for L in (256, 725, 1536, 3000) if L <= cap] or [min(256, cap)]

