"""Run specs and records of the agentic benchmark (`bench.agentic_engine`).

Shared by the replay (which fills the records) and `bench.agentic_report`
(which reads them back and tabulates them), so neither imports the other.
``RUNS`` names every engine run; ``OFFLINE_LABELS`` the offline references.
``linear_fit`` is the least-squares line both use (TTFT calibration, TTFT vs
recomputed tokens).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RunSpec:
    """One engine run. ``policy`` is a `bench.policy.policy_variant` name or None (no hints)."""

    name: str
    label: str
    policy: str | None = None
    engine_args: tuple[str, ...] = ()  # extra `vllm serve` args (tier runs: --kvhint-tiers ...)
    engine_env: tuple[tuple[str, str], ...] = ()

    def resolved_args(self, tiers: str) -> tuple[str, ...]:
        """``{tiers}`` in the engine arguments becomes the --tiers spec."""
        return tuple(a.replace("{tiers}", tiers) for a in self.engine_args)


RUNS: dict[str, RunSpec] = {
    "lru": RunSpec("lru", "(a) vLLM LRU, no hints"),
    "hints": RunSpec("hints", "(b) hints (Pin/Retain, no Release)", "hints"),
    "hints+release": RunSpec("hints+release", "(c) hints + Release on session end", "hints+release"),
    "offload": RunSpec("offload", "(f) OffloadingConnector tiers, no hints", None, ("--kvhint-tiers", "{tiers}")),
    "hints+tiers": RunSpec("hints+tiers", "(g) hints + Release + Demote/Prefetch, tiers", "hints+tiers",
                           ("--kvhint-tiers", "{tiers}")),
    # kvhint_client.policy (bench.policy.LibraryPolicy): expected reuse, learned pauses.
    "policy": RunSpec("policy", "(c2) kvhint_client.policy", "library"),
    "policy+tiers": RunSpec("policy+tiers", "(g2) kvhint_client.policy + tiers", "library+tiers",
                            ("--kvhint-tiers", "{tiers}")),
}
TIER_RUNS = frozenset(name for name, spec in RUNS.items() if spec.engine_args)
OFFLINE_LABELS = {
    "belady": "(d) Belady-MIN, offline (clairvoyant reference)",
    "infinite": "(e) infinite cache, offline (hard limit)",
}


@dataclass
class RequestRecord:
    index: int
    request_id: str
    session_id: str
    prompt_tokens: int
    expected_prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    max_tokens: int
    ttft_s: float
    latency_s: float
    t_send: float  # seconds since replay start
    t_first: float
    t_done: float
    wall_send: float
    wall_done: float
    continuation_id: str
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class RunRecord:
    spec: RunSpec
    records: list[RequestRecord]
    outputs: dict[str, list[int]]
    makespan_s: float
    monitor: dict[str, Any] = field(default_factory=dict)
    hints: dict[str, Any] = field(default_factory=dict)
    loadavg: tuple[float, float] = (math.nan, math.nan)
    usage_samples: list[tuple[float, float]] = field(default_factory=list)
    cpu_samples: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    admission: dict[str, float] = field(default_factory=dict)  # continuation -> engine wall time

    # -- metrics
    @property
    def ok(self) -> bool:
        return all(r.error is None for r in self.records)

    def metrics(self) -> dict[str, Any]:
        recs = [r for r in self.records if r.error is None]
        prompt = sum(r.prompt_tokens for r in recs)
        cached = sum(r.cached_tokens for r in recs)
        ttft = sorted(r.ttft_s * 1000 for r in recs)
        out_tok = sum(r.output_tokens for r in recs)
        tpot = [(r.latency_s - r.ttft_s) * 1000 / (r.output_tokens - 1) for r in recs if r.output_tokens > 1]
        return {
            "requests": len(self.records),
            "answered": len(recs),
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "hit_rate": cached / prompt if prompt else 0.0,
            "recomputed_tokens": prompt - cached,
            "ttft_mean_ms": statistics.fmean(ttft) if ttft else math.nan,
            "ttft_p50_ms": percentile(ttft, 50),
            "ttft_p99_ms": percentile(ttft, 99),
            "latency_mean_ms": statistics.fmean(r.latency_s * 1000 for r in recs) if recs else math.nan,
            # time per output token after the first: decode speed, which a KV connector changes
            "tpot_mean_ms": statistics.fmean(tpot) if tpot else math.nan,
            "makespan_s": self.makespan_s,
            "throughput_req_s": len(recs) / self.makespan_s if self.makespan_s else 0.0,
            "throughput_out_tok_s": out_tok / self.makespan_s if self.makespan_s else 0.0,
            "throughput_prompt_tok_s": prompt / self.makespan_s if self.makespan_s else 0.0,
            **self.monitor,
            "hints": self.hints,
            "loadavg_1m_start_end": list(self.loadavg),
        }


def percentile(sorted_vals: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    if not sorted_vals:
        return math.nan
    k = max(0, min(len(sorted_vals) - 1, math.ceil(p / 100 * len(sorted_vals)) - 1))
    return sorted_vals[k]


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return (ys[0] if ys else math.nan, 0.0)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return (my - b * mx, b)
