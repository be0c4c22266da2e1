"""Engine-neutral KvHint servicer: validation, bounds, executor, SessionPrefixIndex,
retention ledger, event bus and the grpc.aio server. Imports no engine code; an
engine plugs in through `EngineAdapter` (see adapter.py)."""

from .adapter import DeviceOnlyTiers, EngineAdapter, EvictReport, TierTask
from .config import ServerConfig
from .core import KvHintCore
from .server import KvHintServer

__all__ = ["DeviceOnlyTiers", "EngineAdapter", "EvictReport", "KvHintCore", "KvHintServer", "ServerConfig", "TierTask"]
