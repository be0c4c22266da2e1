"""What every CLI command shares: global options, the client built from them, output, and the
mapping of failures to exit codes.

Exit codes (stable, for scripts):
  0  success
  1  the call worked but the answer is negative: some hint not ACCEPTED (apply), not SERVING
     (health), a watch that ended with Resync
  2  usage error: bad flags or values (also INVALID_ARGUMENT from the server)
  3  unavailable: connection refused / unreachable, a failed TLS handshake, or deadline exceeded
  4  any other error status from the server (NOT_FOUND, PERMISSION_DENIED, INTERNAL, ...)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Optional, TextIO

import grpc

from ..client import KvHintClient
from ..config import (
    ADDRESS_ENV,
    DEFAULT_ADDRESS,
    MAX_TIMEOUT_S,
    TOKEN_ENV,
    ConnectionConfig,
    RetryPolicy,
    TlsConfig,
    check_timeout,
)
from ..errors import KvHintError

EXIT_OK = 0
EXIT_NEGATIVE = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3
EXIT_RPC_ERROR = 4

DEFAULT_TIMEOUT = 10.0


class UsageError(Exception):
    """A bad combination of flags the parser could not catch (exit 2)."""


def add_global_options(parser: argparse.ArgumentParser, *, suppress: bool) -> None:
    """The options every command accepts, before or after the command name.

    On the main parser they carry the defaults; on each subcommand they are SUPPRESSed so a
    value given after the command overrides one given before it without resetting it.
    """

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    group = parser.add_argument_group("connection and output")
    group.add_argument(
        "--address",
        default=default(os.environ.get(ADDRESS_ENV, DEFAULT_ADDRESS)),
        help=f"server host:port (default: ${ADDRESS_ENV} or {DEFAULT_ADDRESS})",
    )
    group.add_argument(
        "--timeout", type=float, default=default(DEFAULT_TIMEOUT), metavar="SECONDS",
        help=f"deadline per call, retries included (default {DEFAULT_TIMEOUT:g}; at most {MAX_TIMEOUT_S:.0f})",
    )
    _add_json_option(group, default(False))
    group.add_argument("--token", default=default(os.environ.get(TOKEN_ENV)), help=f"bearer token (default: ${TOKEN_ENV})")
    group.add_argument("--retries", type=int, default=default(2), metavar="N", help="retries on UNAVAILABLE (default 2)")
    group.add_argument("--tls", action="store_true", default=default(False), help="use TLS (implied by the options below)")
    group.add_argument("--ca-cert", default=default(None), metavar="PEM", help="CA bundle to verify the server")
    group.add_argument("--cert", default=default(None), metavar="PEM", help="client certificate (mutual TLS)")
    group.add_argument("--key", default=default(None), metavar="PEM", help="client private key (mutual TLS)")
    group.add_argument("--server-name", default=default(None), help="TLS server name override")


def _add_json_option(group: Any, default: Any) -> None:
    group.add_argument("--json", action="store_true", default=default, help="print JSON instead of tables")


def output_options() -> argparse.ArgumentParser:
    """The parent parser of a command that talks to no KvHint server (make-tiny-model): of the
    global options only --json, SUPPRESSed as on the common parent; the connection options would
    do nothing there, so its help does not list them."""
    parser = argparse.ArgumentParser(add_help=False)
    _add_json_option(parser.add_argument_group("output"), argparse.SUPPRESS)
    return parser


@dataclass
class CliContext:
    """Per-invocation state handed to every command's run(args, ctx)."""

    args: argparse.Namespace
    out: TextIO = field(default_factory=lambda: sys.stdout)
    err: TextIO = field(default_factory=lambda: sys.stderr)
    _client: Optional[KvHintClient] = None

    @property
    def json(self) -> bool:
        return bool(getattr(self.args, "json", False))

    @property
    def address(self) -> str:
        return str(getattr(self.args, "address", DEFAULT_ADDRESS))

    @property
    def timeout(self) -> float:
        return float(getattr(self.args, "timeout", DEFAULT_TIMEOUT))

    @property
    def tls(self) -> bool:
        """Whether the connection uses TLS (--tls, or any of the options that imply it)."""
        return any(getattr(self.args, a, None) for a in ("tls", "ca_cert", "cert", "key", "server_name"))

    def config(self) -> ConnectionConfig:
        args = self.args
        try:
            check_timeout(self.timeout, "--timeout")
        except ValueError as error:
            raise UsageError(str(error)) from None
        retries = getattr(args, "retries", 2)
        if retries < 0:
            raise UsageError("--retries must be >= 0")
        token = getattr(args, "token", None) or None
        if token is not None and not all(" " <= c <= "~" for c in token):
            # gRPC refuses it as a header value only when the call is made (INTERNAL, exit 4)
            raise UsageError(f"--token / ${TOKEN_ENV} must be printable ASCII (no newline, control or non-ASCII characters)")
        tls = None
        ca, cert, key, name = (getattr(args, a, None) for a in ("ca_cert", "cert", "key", "server_name"))
        for flag, path in (("--ca-cert", ca), ("--cert", cert), ("--key", key)):
            if path and not os.path.isfile(path):
                raise UsageError(f"{flag} {path}: no such file")
        if bool(cert) != bool(key):  # TlsConfig's message names its Python arguments
            given, missing = ("--cert", "--key") if cert else ("--key", "--cert")
            raise UsageError(f"{given} needs {missing}: mutual TLS takes the client certificate (--cert) and its "
                             "private key (--key) together")
        if self.tls:
            try:
                tls = TlsConfig(root_certificates=ca, certificate_chain=cert, private_key=key, server_name_override=name)
            except ValueError as error:
                raise UsageError(str(error)) from None
        try:
            return ConnectionConfig(
                address=self.address,
                tls=tls,
                bearer_token=token,
                default_timeout=self.timeout,
                retry=RetryPolicy(max_attempts=retries + 1, initial_backoff=0.1, max_backoff=1.0),
            )
        except ValueError as error:  # e.g. an empty --address / KVHINT_ADDRESS
            raise UsageError(str(error)) from None

    def client(self) -> KvHintClient:
        if self._client is None:
            self._client = KvHintClient(self.config())
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    # -- output ----------------------------------------------------------------------------------

    def print(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def emit_json(self, value: Any) -> None:
        """One indented JSON document on stdout."""
        print(json.dumps(value, indent=2), file=self.out, flush=True)

    def emit_json_line(self, value: Any) -> None:
        """One compact JSON object per line (streams)."""
        print(json.dumps(value, separators=(",", ":")), file=self.out, flush=True)

    def fail(self, message: str) -> None:
        print(f"kvhint: {message}", file=self.err, flush=True)


def describe_error(error: KvHintError, ctx: CliContext) -> tuple[str, int]:
    """(one-line message, exit code) for a failed call."""
    address = error.address or ctx.address
    method = error.method or "the call"
    if error.code == grpc.StatusCode.UNAVAILABLE:
        return _unavailable(error.details or "unavailable", address, ctx.tls), EXIT_UNAVAILABLE
    if error.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return (
            f"deadline exceeded: no answer from {address} to {method} within {ctx.timeout:g}s"
            + (f" ({error.details})" if error.details and "Deadline" not in error.details else ""),
            EXIT_UNAVAILABLE,
        )
    extras = []
    if error.reason:
        extras.append(f"reason {error.reason}")
    if error.field:
        extras.append(f"field {error.field}")
    suffix = f" ({', '.join(extras)})" if extras else ""
    if error.code == grpc.StatusCode.INVALID_ARGUMENT:
        return f"invalid argument: {error.details}{suffix}", EXIT_USAGE
    return f"{method} failed: {error.code.name}: {error.details}{suffix}", EXIT_RPC_ERROR


# gRPC's words for a failed TLS handshake, in the detail of an UNAVAILABLE status.
_HANDSHAKE = re.compile(r"handshake|ssl|certificate|tsi_|hostname verification", re.IGNORECASE)
_TLS_CHECKS = ("check --ca-cert (the CA that signed the server's certificate), --server-name (a name in that "
               "certificate, when the address's host is not) and, where the server requires client certificates, "
               "--cert/--key (a certificate its CA signed, and its key)")


def _unavailable(detail: str, address: str, tls: bool) -> str:
    """The message of an UNAVAILABLE status. gRPC's detail is the error of the last address it tried
    ("localhost" is ::1 and 127.0.0.1: a refused ::1 can hide 127.0.0.1's failed TLS handshake), so
    with TLS a refused or closed connection may be a handshake failure too, and the message says
    so; a detail that names the handshake's failure is reported as one."""
    last = detail.split("last error: ", 1)[-1]
    if _HANDSHAKE.search(last):
        if "WRONG_VERSION_NUMBER" in last:
            why = ": the server may not serve TLS"
        elif "CERTIFICATE_VERIFY_FAILED" in last:
            why = ": the server's certificate is not signed by a CA in --ca-cert"
        elif "hostname verification" in last.lower():
            why = ": the server's certificate is not for the name dialled (--server-name sets the name checked)"
        else:
            why = ""
        return f"cannot reach the KvHint server at {address}: the TLS handshake failed{why} (gRPC: {last}); {_TLS_CHECKS}"
    if "connection refused" in detail.lower():
        detail = "connection refused"
    message = f"cannot reach the KvHint server at {address}: {detail}"
    if tls:
        return (f"{message}. With TLS a failed handshake (a wrong --ca-cert, a certificate for another name, a "
                f"missing or untrusted client certificate) can show the same way: if the server is up, {_TLS_CHECKS}")
    if "socket closed" in last.lower():
        return f"{message} (a server that serves TLS closes a plaintext connection like this: try --tls or --ca-cert)"
    return message
