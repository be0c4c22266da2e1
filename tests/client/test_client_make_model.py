"""`kvhint make-tiny-model`, in process (torch and transformers are already imported by the
fast tier's vLLM imports, so this costs the checkpoint, not a second interpreter's imports; the
entry point itself is covered by tests/client/test_client_cli.py's subprocess tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvhint_client.cli import main


def test_make_tiny_model_writes_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    assert main(["make-tiny-model", str(tmp_path / "m"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"path": str(tmp_path / "m"), "preset": "tiny"}
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["vocab_size"] == 4096
    assert any(p.suffix == ".safetensors" for p in (tmp_path / "m").iterdir())


def test_the_mamba_preset_writes_a_granite_4_hybrid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    assert main(["make-tiny-model", str(tmp_path / "m"), "--preset", "mamba", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["preset"] == "mamba"
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    # vLLM resolves the architecture to its GraniteMoeHybrid (Mamba2 + attention) implementation
    assert config["architectures"] == ["GraniteMoeHybridForCausalLM"]
    # (transformers writes the Mamba2 layers as "linear_attention")
    assert config["layer_types"] == ["linear_attention", "full_attention", "linear_attention", "full_attention"]
    assert config["num_local_experts"] == 0 and config["vocab_size"] == 4096
    assert (tmp_path / "m" / "tokenizer.json").exists()


def test_the_window_preset_writes_a_qwen2_whose_every_layer_slides(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    assert main(["make-tiny-model", str(tmp_path / "m"), "--preset", "window", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["preset"] == "window"
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    # vLLM 0.32 serves Qwen2 with all layers sliding (one sliding-window KV-cache group) but refuses a mix
    assert config["layer_types"] == ["sliding_attention"] * 4 and config["sliding_window"] == 128
    assert config["use_sliding_window"] is True and config["max_window_layers"] == 0


def test_a_dir_that_cannot_be_written_is_a_one_line_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    (tmp_path / "f").write_text("a file, not a directory")
    for target in (tmp_path / "f", tmp_path / "f" / "m"):
        assert main(["make-tiny-model", str(target)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"kvhint: make-tiny-model: cannot write {tmp_path / 'f'}") and len(err.splitlines()) == 1, err
