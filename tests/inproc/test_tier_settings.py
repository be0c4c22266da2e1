"""TierSettings: tier configuration parsed and validated once, errors naming their source."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine_integration.tiers.settings import (
    DEFAULT_OP_TIMEOUT_S,
    OP_TIMEOUT_ENV,
    PEERS_ENV,
    TierSettings,
    parse_peers,
)


def test_defaults_without_configuration() -> None:
    s = TierSettings.from_sources({}, env={})
    assert s.peers == {} and s.op_timeout_s == DEFAULT_OP_TIMEOUT_S


def test_environment_adds_peers_and_overrides_the_launcher_timeout() -> None:
    extra = {"kvhint_share_peers": {"b": "10.0.0.2:50151"}, "kvhint_tier_op_timeout_s": 9}
    s = TierSettings.from_sources(extra, env={PEERS_ENV: "c=h3:1;b=h2:2", OP_TIMEOUT_ENV: "2.5"})
    assert s.peers == {"b": "h2:2", "c": "h3:1"}
    assert s.op_timeout_s == 2.5
    assert TierSettings.from_sources(extra, env={}).op_timeout_s == 9


@pytest.mark.parametrize("raw", ["nan", "inf", "0", "-1", "soon"])
def test_a_bad_timeout_names_its_variable(raw: str) -> None:
    with pytest.raises(ValueError, match=OP_TIMEOUT_ENV):
        TierSettings.from_sources({}, env={OP_TIMEOUT_ENV: raw})
    with pytest.raises(ValueError, match="kvhint_tier_op_timeout_s"):
        TierSettings.from_sources({"kvhint_tier_op_timeout_s": raw}, env={})


@pytest.mark.parametrize("raw", ["b", "b=", "=h:1", "b=host", "b=host:port", "b=:1", "garbage", "c=h:1,oops"])
def test_a_bad_peer_names_its_variable_and_quotes_the_entry(raw: str) -> None:
    bad = raw.split(",")[-1]
    with pytest.raises(ValueError, match=PEERS_ENV) as err:
        TierSettings.from_sources({}, env={PEERS_ENV: raw})
    assert f"share peer {bad!r}: expected NAME=HOST:PORT" in str(err.value)  # 'garbage' was quoted as ''


names = st.text(alphabet="abcdefgh-", min_size=1, max_size=6)
addresses = st.builds(lambda h, p: f"{h}:{p}", st.sampled_from(["127.0.0.1", "h", "[::1]"]), st.integers(1, 65535))


@given(st.dictionaries(names, addresses, max_size=5), st.sampled_from([",", ";", "+"]))
def test_peer_strings_and_mappings_parse_alike(peers: dict[str, str], sep: str) -> None:
    text = sep.join(f"{n}={a}" for n, a in peers.items())
    assert parse_peers(text) == peers
    assert parse_peers(peers) == peers
