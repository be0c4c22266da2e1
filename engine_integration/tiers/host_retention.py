"""HostRetention: the host tier's eviction order from the hints in effect.

`host_policy.KvHintHostPolicy` (the host tier's CachePolicy) asks `rank(key)`
for each eviction candidate while some hint is in effect. The order is the
proto's (TierInfo.honours_retention):

  None                      no unexpired grant protects the block: the tier's own (LRU) order
  (0,)                      protected, but the device still holds it (the host copy is read only
                            once the device copy is gone)
  (1, priority, a, b)       retained; within a priority (a, b) = (0, 0) for no or a passed
                            expectation (LRU among them), else (1, -reuse_at): furthest first
  (2, 0, a, b)              pinned, in the same order

Smaller goes first; ties go in LRU order (the policy's). The key is vLLM's
offload key (block hash + 4-byte group id): every group's copy of a logical block
ranks as the block. Engine thread only.
"""

from __future__ import annotations

import logging
from typing import Any

from kvhint_server.model import RetentionClass

from .. import vllm_private
from .host_policy import KvHintHostPolicy

log = logging.getLogger("kvhint.tiers")


class HostRetention:
    @classmethod
    def attach(cls, primary: Any, adapter: Any) -> HostRetention | None:
        """Rank for the host tier's policy when it is `KvHintHostPolicy`; None (the tier keeps its
        own order, TierInfo.honours_retention false) for any other policy."""
        policy = vllm_private.host_cache_policy(primary)
        if not isinstance(policy, KvHintHostPolicy):
            log.info("kvhint tiers: host tier eviction policy %s; hints protect device copies only",
                     type(policy).__name__)
            return None
        me = cls(adapter)
        policy.attach(me.rank, adapter.retention_active)
        return me

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter
        self.core = adapter.core

    def rank(self, key: bytes) -> tuple[float, ...] | None:
        adapter = self.adapter
        ext = adapter.external(key[:-4])
        view = self.core.retention(ext)
        if view.cls is RetentionClass.ORDINARY:
            return None
        if adapter.device_resident(ext):
            return (0,)
        at = view.reuse_at
        a, b = (0, 0.0) if at is None or at <= self.core.monotonic() else (1, -at)
        if view.cls is RetentionClass.PINNED:
            return (2, 0, a, b)
        return (1, view.priority, a, b)
