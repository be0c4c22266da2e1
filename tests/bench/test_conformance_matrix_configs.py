"""`python -m bench.conformance_matrix --configs`: which engine configurations a run serves (no engine)."""

from __future__ import annotations

import argparse

import pytest

from bench.conformance_matrix import CONFIGS, main, parse_configs


def test_presets_with_optional_tiers() -> None:
    assert parse_configs("window") == (("window", ""),)
    assert parse_configs("window, tiny@host=128") == (("window", ""), ("tiny", "host=128"))


def test_a_tiers_value_keeps_its_own_commas() -> None:
    """--kvhint-tiers values are comma-separated keys too: `host-eviction=kvhint` after a
    configuration with tiers is that configuration's, not a preset."""
    assert parse_configs("tiny@host=128,host-eviction=kvhint,hybrid") == (
        ("tiny", "host=128,host-eviction=kvhint"), ("hybrid", ""))
    assert ("hybrid", "host=128,host-eviction=kvhint") in CONFIGS


@pytest.mark.parametrize("text", ["", " , ", "llama", "window,nope@host=128", "host-eviction=kvhint,tiny"])
def test_an_unknown_or_missing_preset_is_a_usage_error(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_configs(text)


def test_the_command_line_refuses_it_before_serving_anything(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--configs", "nope"])
    assert exit_.value.code == 2 and "unknown model preset 'nope'" in capsys.readouterr().err
    assert ("tiny", "") in CONFIGS  # the default matrix is unchanged


def test_the_results_header_names_the_options_that_reproduce_it() -> None:
    from pathlib import Path

    from bench.conformance_matrix import RESULTS, command_args

    assert command_args(CONFIGS, RESULTS) == ""
    out = RESULTS.parent / "conformance_window.md"
    assert command_args((("window", ""),), out) == " --configs window --out bench/results/conformance_window.md"
    assert command_args((("tiny", "host=128"),), Path("/tmp/x.md")) == " --configs tiny@host=128 --out /tmp/x.md"
