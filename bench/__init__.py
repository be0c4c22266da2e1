"""KvHint offline benchmark: agentic traces, cache simulators, reference hint policy.

Modules:
  bench.trace     JSON-lines trace format (header + time-ordered events)
  bench.generate  deterministic trace generator (`generate_trace`, `PRESETS`)
  bench.simulate  LRU (vLLM BlockPool semantics), Belady-MIN, infinite and
                  hint-aware cache simulators; `analyze` prints the headroom table
  bench.policy    reference hint policy (causal function of runtime signals)
  bench.cli       `python -m bench generate|analyze|policy`
"""

from bench.generate import PRESETS, TraceParams, generate_trace, make_heldout
from bench.policy import PolicyConfig, ReferencePolicy, run_policy
from bench.simulate import (
    analyze,
    compile_trace,
    peak_live_blocks,
    simulate_belady,
    simulate_hinted,
    simulate_infinite,
    simulate_lru,
)
from bench.trace import Trace, TraceHeader

__all__ = [
    "PRESETS",
    "PolicyConfig",
    "ReferencePolicy",
    "Trace",
    "TraceHeader",
    "TraceParams",
    "analyze",
    "compile_trace",
    "generate_trace",
    "make_heldout",
    "peak_live_blocks",
    "run_policy",
    "simulate_belady",
    "simulate_hinted",
    "simulate_infinite",
    "simulate_lru",
]
