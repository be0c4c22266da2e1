"""`python -m bench.conformance_matrix --configs`: which engine configurations a run serves (no engine)."""

from __future__ import annotations

import argparse

import pytest

from bench.conformance_matrix import CONFIGS, main, parse_configs


def test_presets_with_optional_tiers() -> None:
    assert parse_configs("window") == (("window", ""),)
    assert parse_configs("window, tiny@host=128") == (("window", ""), ("tiny", "host=128"))


@pytest.mark.parametrize("text", ["", " , ", "llama", "window,nope@host=128"])
def test_an_unknown_or_missing_preset_is_a_usage_error(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_configs(text)


def test_the_command_line_refuses_it_before_serving_anything(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--configs", "nope"])
    assert exit_.value.code == 2 and "unknown model preset 'nope'" in capsys.readouterr().err
    assert ("tiny", "") in CONFIGS  # the default matrix is unchanged
