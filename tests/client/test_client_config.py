"""Connection config: retry policy contract, metadata, TLS validation."""

from __future__ import annotations

import math
import random

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhint_client.config import MAX_TIMEOUT_S, ConnectionConfig, RetryPolicy, TlsConfig, as_config


def test_only_unavailable_is_retryable() -> None:
    assert RetryPolicy.retryable(grpc.StatusCode.UNAVAILABLE)
    for code in grpc.StatusCode:
        if code is not grpc.StatusCode.UNAVAILABLE:
            assert not RetryPolicy.retryable(code), code


def test_backoff_grows_to_the_cap_within_jitter() -> None:
    policy = RetryPolicy(initial_backoff=0.1, max_backoff=1.0, multiplier=2.0, jitter=0.0)
    assert [policy.backoff(n) for n in range(1, 6)] == [0.1, 0.2, 0.4, 0.8, 1.0]
    jittery = RetryPolicy(initial_backoff=1.0, max_backoff=1.0, jitter=0.25)
    rng = random.Random(7)
    samples = [jittery.backoff(1, rng) for _ in range(200)]
    assert all(0.75 <= s <= 1.25 for s in samples) and max(samples) - min(samples) > 0.1
    assert RetryPolicy.disabled().max_attempts == 1


@settings(max_examples=200, deadline=None)
@given(
    initial=st.floats(0, 10), cap=st.floats(0, 60), multiplier=st.floats(1, 1000),
    failed=st.integers(1, 10**9), integer_multiplier=st.booleans(),
)
def test_backoff_stays_within_the_cap_however_many_attempts_failed(initial, cap, multiplier, failed, integer_multiplier) -> None:
    """A follower passes its count of failed reconnects, which grows while an engine is down (about
    1024 after 8 minutes with the default policy): the backoff is a number in [0, max_backoff],
    never an OverflowError that would end the follower's thread."""
    policy = RetryPolicy(initial_backoff=initial, max_backoff=cap, multiplier=int(multiplier) if integer_multiplier else multiplier, jitter=0.0)
    delay = policy.backoff(failed)
    assert 0.0 <= delay <= cap
    assert delay == min(cap, initial) or failed > 1 or initial == 0


def test_the_default_reconnect_policy_after_an_hour_down_waits_its_cap() -> None:
    from kvhint_client.follower import DEFAULT_RECONNECT

    assert DEFAULT_RECONNECT.backoff(1025) == pytest.approx(DEFAULT_RECONNECT.max_backoff, rel=DEFAULT_RECONNECT.jitter)
    assert DEFAULT_RECONNECT.backoff(10**6) <= DEFAULT_RECONNECT.max_backoff * (1 + DEFAULT_RECONNECT.jitter)


@pytest.mark.parametrize("kwargs", [{"max_attempts": 0}, {"multiplier": 0.5}, {"jitter": 1.5}, {"initial_backoff": -1}])
def test_invalid_retry_policies_are_rejected(kwargs) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)


def test_bearer_token_goes_first_in_call_metadata() -> None:
    config = ConnectionConfig(bearer_token="tok", metadata=(("x-a", "1"),))
    assert config.call_metadata() == (("authorization", "Bearer tok"), ("x-a", "1"))
    assert ConnectionConfig().call_metadata() == ()


def test_from_env_and_address_strings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVHINT_ADDRESS", "10.1.1.1:9")
    monkeypatch.setenv("KVHINT_TOKEN", "t")
    config = ConnectionConfig.from_env(default_timeout=3.0)
    assert (config.address, config.bearer_token, config.default_timeout) == ("10.1.1.1:9", "t", 3.0)
    assert as_config("h:1").address == "h:1" and as_config(config) is config
    with pytest.raises(ValueError, match="default_timeout"):
        ConnectionConfig(default_timeout=0)


def test_tls_needs_both_halves_of_a_client_certificate() -> None:
    with pytest.raises(ValueError, match="both certificate_chain and private_key"):
        TlsConfig(certificate_chain=b"cert")
    tls = TlsConfig(server_name_override="kvhint.internal")
    assert ("grpc.ssl_target_name_override", "kvhint.internal") in ConnectionConfig(tls=tls).all_channel_options()
    assert isinstance(tls.channel_credentials(), grpc.ChannelCredentials)


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, 1e10, MAX_TIMEOUT_S * 2])
def test_a_default_timeout_grpc_cannot_honour_is_refused_naming_the_field(bad: float) -> None:
    """inf or ~1e10 s used to be accepted, and then every call failed DEADLINE_EXCEEDED unsent."""
    with pytest.raises(ValueError, match=r"default_timeout must be a finite number of seconds > 0 and at most 2147483648"):
        ConnectionConfig("h:1", default_timeout=bad)


def test_the_longest_default_timeout_and_none_are_accepted() -> None:
    assert ConnectionConfig("h:1", default_timeout=MAX_TIMEOUT_S).default_timeout == MAX_TIMEOUT_S
    assert ConnectionConfig("h:1", default_timeout=None).default_timeout is None
