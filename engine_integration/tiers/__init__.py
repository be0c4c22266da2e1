"""KV tiers for KvHint: G2 host memory and G3 files, on vLLM's OffloadingConnector.

* `cpu_spec`  out-of-tree OffloadingSpecs that make the connector run on the CPU
              backend (`TorchCPUOffloadingSpec`, `TorchTieringOffloadingSpec`).
* `config`    `tier_kv_transfer_config(...)`: the kv_transfer_config for CPU (our
              specs) or CUDA (vLLM's built-in specs) in one call.
* `control`   scheduler-side control surface for Demote / Prefetch / Share and the
              connector's residency events (`TierControl`, `Prefetch`).

README.md in this folder documents the control surface, the verified numbers, the
vLLM code it relies on (file:line, vLLM 0.32) and what the connector cannot do.
Importing this package imports nothing from vLLM.
"""
