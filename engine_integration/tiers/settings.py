"""TierSettings: the tier runtime's configuration, parsed and validated once.

Sources, later ones winning: the `kv_connector_extra_config` keys that
`kvhint-vllm --kvhint-tiers` writes (`kvhint_share_peers`,
`kvhint_tier_op_timeout_s`), then the environment:

  KVHINT_SHARE_PEERS        Share destinations, "NAME=HOST:PORT[,NAME=HOST:PORT...]"
                            (',' ';' or '+' separate entries); added to the
                            launcher's peers, overriding a peer of the same name.
  KVHINT_TIER_OP_TIMEOUT_S  seconds a Demote/Prefetch/Share operation may take
                            before it FAILS with DEADLINE_EXCEEDED (default 60).

Every error names the variable or key it came from.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

PEERS_ENV = "KVHINT_SHARE_PEERS"
OP_TIMEOUT_ENV = "KVHINT_TIER_OP_TIMEOUT_S"
PEERS_KEY = "kvhint_share_peers"
OP_TIMEOUT_KEY = "kvhint_tier_op_timeout_s"
DEFAULT_OP_TIMEOUT_S = 60.0


def parse_peers(raw: Any, *, source: str = PEERS_ENV) -> dict[str, str]:
    """Share peers from `{"b": "host:port"}` or "b=host:port,c=host:port"
    (entries separated by ',', ';' or '+'). Raises ValueError naming `source`."""
    if not raw:
        return {}
    # (name, address, the entry as the source wrote it: the error quotes it)
    items: list[tuple[str, str, str]] = []
    if isinstance(raw, Mapping):
        items = [(str(k), str(v), f"{k}={v}") for k, v in raw.items()]
    else:
        for entry in str(raw).replace(";", ",").replace("+", ",").split(","):
            entry = entry.strip()
            if not entry:
                continue
            name, sep, address = entry.partition("=")
            items.append((name if sep else "", address, entry))
    out: dict[str, str] = {}
    for name, address, entry in items:
        name, address = name.strip(), address.strip()
        host, colon, port = address.rpartition(":")
        if not name or not colon or not host or not port.isdigit():
            raise ValueError(f"{source}: share peer {entry!r}: expected NAME=HOST:PORT")
        out[name] = address
    return out


def _positive_seconds(raw: Any, source: str) -> float:
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{source}={raw!r}: expected a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{source}={raw!r}: must be a finite number of seconds > 0")
    return value


@dataclass(frozen=True)
class TierSettings:
    peers: dict[str, str] = field(default_factory=dict)
    op_timeout_s: float = DEFAULT_OP_TIMEOUT_S

    @classmethod
    def from_sources(cls, extra_config: Mapping[str, Any] | None = None,
                     env: Mapping[str, str] | None = None) -> TierSettings:
        """Settings from the connector's extra config and the environment."""
        extra = dict(extra_config or {})
        env = os.environ if env is None else env
        peers = parse_peers(extra.get(PEERS_KEY), source=f"kv_connector_extra_config.{PEERS_KEY}")
        peers.update(parse_peers(env.get(PEERS_ENV, ""), source=PEERS_ENV))
        timeout = DEFAULT_OP_TIMEOUT_S
        if extra.get(OP_TIMEOUT_KEY) is not None:
            timeout = _positive_seconds(extra[OP_TIMEOUT_KEY], f"kv_connector_extra_config.{OP_TIMEOUT_KEY}")
        if env.get(OP_TIMEOUT_ENV):
            timeout = _positive_seconds(env[OP_TIMEOUT_ENV], OP_TIMEOUT_ENV)
        return cls(peers=peers, op_timeout_s=timeout)
