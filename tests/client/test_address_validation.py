"""Client-side address checks (found by a router engineer's trial): gRPC takes `127.0.0.1:99999`
as port 34463 (99999 - 65536), a URL as a host name and a bare host as port 443, so a mistyped
address connected somewhere else, or was retried for ever as UNAVAILABLE (the follower, the
FleetClient) and reported by the CLI as "connection refused" (exit 3). The server refused the
same value at start. Now ConnectionConfig refuses it (ValueError), and with it KvHintClient,
EventFollower, FleetClient and the CLI (usage error, exit 2), before connecting anywhere."""

from __future__ import annotations

import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_client_cli import kvhint

from kvhint_client import KvHintClient
from kvhint_client.config import ConnectionConfig, check_address
from kvhint_client.fleet import FleetClient
from kvhint_client.follower import EventFollower

BAD = ["127.0.0.1:99999", "127.0.0.1:65536", "127.0.0.1:0", "http://127.0.0.1:50310", "https://kv.example:443",
       "not-an-address", "::1", "h:", ":50151", "a b:1"]
GOOD = ["127.0.0.1:50151", "localhost:1", "kv.example.com:65535", "[::1]:50151", "unix:/tmp/kvhint.sock",
        "unix-abstract:kvhint", "dns:///kv.example.com:50151", "ipv4:127.0.0.1:50151"]


@pytest.mark.parametrize("address", BAD)
def test_a_bad_address_is_refused_by_every_client(address: str) -> None:
    for make in (lambda: ConnectionConfig(address=address), lambda: KvHintClient(address),
                 lambda: EventFollower({"e1": address}), lambda: FleetClient({"e1": address})):
        with pytest.raises(ValueError, match="address"):
            make()


@pytest.mark.parametrize("address", GOOD)
def test_host_port_and_grpc_targets_are_accepted(address: str) -> None:
    assert ConnectionConfig(address=address).address == address


@given(port=st.integers(-10, 200_000), host=st.sampled_from(["127.0.0.1", "localhost", "kv-1.example", "[::1]"]))
def test_a_port_is_accepted_exactly_when_a_socket_could_use_it(port: int, host: str) -> None:
    address = f"{host}:{port}"
    if 1 <= port <= 65535:
        check_address(address)
    else:
        with pytest.raises(ValueError):
            check_address(address)


def test_the_out_of_range_port_reaches_no_listener_on_its_wrapped_port() -> None:
    """What the check prevents: a listener on 99999 - 65536 is not connected to."""
    with socket.socket() as listener:
        try:
            listener.bind(("127.0.0.1", 99999 - 65536))
        except OSError:
            pytest.skip("port 34463 is taken here")
        listener.listen(1)
        listener.settimeout(0.5)
        with pytest.raises(ValueError):
            KvHintClient("127.0.0.1:99999")
        with pytest.raises(socket.timeout):
            listener.accept()


def test_the_cli_calls_a_bad_address_a_usage_error() -> None:
    for address in ("127.0.0.1:99999", "http://127.0.0.1:50310"):
        run = kvhint("--address", address, "capabilities")
        assert run.returncode == 2, (address, run.returncode, run.stderr)
        assert "address" in run.stderr and "refused" not in run.stderr, run.stderr
