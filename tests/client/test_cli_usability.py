"""What a new user following the README meets with the CLI and the Python client, against the
fake server: envelope errors said once, an empty selector value named as empty, commands that talk
to no server taking no connection flags, and the README's "Talking to it" snippet and example
envelope working as written."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
from fake_kvhint_server import RunningServer, h
from test_client_cli import kvhint

from engine_integration.served import EngineSpec
from kvhint.v1 import kvhint_pb2

README = Path(__file__).resolve().parents[2] / "README.md"
CONNECTION_FLAGS = ("--address", "--timeout", "--token", "--retries", "--tls", "--ca-cert", "--cert", "--key",
                    "--server-name")


def readme_section(title: str) -> str:
    """The README text under `## title` (or `### title`) up to the next heading of level 2."""
    text = README.read_text(encoding="utf-8")
    start = re.search(rf"^##+ {re.escape(title)}\n", text, re.M)
    assert start, f"README has no section {title!r}"
    rest = text[start.end():]
    end = re.search(r"^## ", rest, re.M)
    return rest[:end.start()] if end else rest


def fenced(section: str, language: str) -> str:
    match = re.search(rf"```{language}\n(.*?)```", section, re.S)
    assert match, f"no ```{language} block"
    return match.group(1)


# -- envelope errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("envelope", "message"), [
    ({"message_id": "m", "actions": []}, "kvhint: envelope: missing 'protocol_version'"),
    ({"protocol_version": "9", "message_id": "m", "actions": []},
     "kvhint: envelope: unsupported protocol_version '9'; supported: 0.1"),
    ([], "kvhint: envelope must be an object, got list"),
    ({"protocol_version": "0.1", "message_id": "m", "actions": [{"action_id": "a"}]},
     "kvhint: envelope: action 0 (id 'a'): missing 'action_type'"),
])
def test_a_bad_envelope_file_is_named_once(fake: RunningServer, tmp_path: Path, envelope: object, message: str) -> None:
    path = tmp_path / "envelope.json"
    path.write_text(json.dumps(envelope), encoding="utf-8")
    run = kvhint("apply", "--envelope", str(path), address=fake.address)
    assert run.returncode == 2 and run.stderr.splitlines() == [message], run.stderr
    assert fake.servicer.count("ApplyHints") == 0


# -- empty selector values -----------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "message"), [
    (["apply", "pin", "--session", "", "--ttl", "5"], "kvhint: --session is empty: give a session id"),
    (["apply", "pin", "--continuation", "", "--ttl", "5"], "kvhint: --continuation is empty: give a continuation id"),
    (["apply", "evict", "--block-hash", "00ff", "--block-hash", ""],
     "kvhint: --block-hash is empty: give a block hash in hex"),
    # an empty --range was dropped: the whole session was evicted
    (["apply", "evict", "--session", "S", "--range", ""], "kvhint: --range is empty: give START:END or START:"),
    (["residency", "--session", ""], "kvhint: --session is empty: give a session id"),
])
def test_an_empty_selector_value_is_named_as_empty(fake: RunningServer, args: list[str], message: str) -> None:
    run = kvhint(*args, address=fake.address)
    assert run.returncode == 2 and run.stderr.splitlines() == [message], run.stderr
    assert fake.servicer.count("ApplyHints") == 0 and fake.servicer.count("QueryResidency") == 0


# -- commands that talk to no server -----------------------------------------------------------------


def test_make_tiny_model_demo_and_bench_list_no_connection_flags() -> None:
    model_help = kvhint("make-tiny-model", "--help")
    demo_help = kvhint("demo", "--help")
    bench_help = kvhint("bench", "--help")
    assert model_help.returncode == 0 and demo_help.returncode == 0 and bench_help.returncode == 0
    for flag in CONNECTION_FLAGS:
        assert f" {flag} " not in model_help.stdout and f"[{flag}" not in model_help.stdout, flag
        assert f" {flag} " not in demo_help.stdout and f"[{flag}" not in demo_help.stdout, flag
        # `bench` passes what follows its tool through (`bench run --grpc ...`): none of its own
        assert f" {flag} " not in bench_help.stdout and f"[{flag}" not in bench_help.stdout, flag
    assert "--json" in model_help.stdout  # make-tiny-model prints its result as JSON on request
    assert "--json" not in demo_help.stdout  # the demo prints text only
    bench = kvhint("bench", "--address", "x:1", "analyze")  # refused, not silently ignored
    assert bench.returncode == 2 and "kvhint bench: error" in bench.stderr, bench.stderr
    for args in (["demo", "--address", "x:1"], ["make-tiny-model", "/nonexistent/m", "--tls"]):
        run = kvhint(*args)
        assert run.returncode == 2 and "unrecognized arguments" in run.stderr, (args, run.stderr)
    # the commands that do talk to a server keep them
    assert "--address" in kvhint("capabilities", "--help").stdout


# -- the README --------------------------------------------------------------------------------------


def test_the_readme_python_snippet_runs_as_written_and_names_tiers(fake: RunningServer) -> None:
    snippet = fenced(readme_section("Talking to it"), "python")
    assert '"127.0.0.1:50151"' in snippet
    fake.servicer.blocks = [kvhint_pb2.BlockInfo(block_hash=h(i), position=i, tiers=[kvhint_pb2.TIER_DEVICE],
                                                 session_ids=["agent-7"]) for i in range(3)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(snippet.replace("127.0.0.1:50151", fake.address), "README.md", "exec"), {})
    assert out.getvalue() == "{'device': 3}\n"
    [pin] = fake.servicer.applied
    assert pin.selector.session.session_id == "agent-7" and pin.pin.ttl.seconds == 30


def test_the_readme_example_envelope_applies(fake: RunningServer, tmp_path: Path) -> None:
    path = tmp_path / "envelope.json"
    path.write_text(fenced(readme_section("Talking to it"), "json"), encoding="utf-8")
    run = kvhint("apply", "--envelope", str(path), "--json", address=fake.address)
    assert run.returncode == 0, run.stderr
    [pin] = fake.servicer.applied
    assert (pin.hint_id, pin.selector.session.session_id, pin.pin.ttl.seconds) == ("pin-agent-7", "agent-7", 30)


def test_the_readme_prefix_hit_recipe_serves_what_the_results_were_measured_on() -> None:
    """The recipe's pool is the one bench/results/hybrid_resume.md (the figures it cites) ran with:
    EngineSpec's defaults, with the cached-token counts on."""
    recipe = fenced(readme_section("See a hint keep a prefix hit"), "bash")
    spec = EngineSpec(model="m")
    for flag in (f"--block-size {spec.block_size}", f"--num-gpu-blocks-override {spec.num_gpu_blocks}",
                 f"--max-model-len {spec.max_model_len}", "--enable-prompt-tokens-details",
                 "--scheduler-cls engine_integration.scheduler.KvHintScheduler", "scripts/resume_scenario.py"):
        assert flag in recipe, flag
    results = (README.parent / "bench" / "results" / "hybrid_resume.md").read_text(encoding="utf-8")
    assert "| tiny | 80 | 0: full_attention | no hint | 6 | - | - | 0 |" in results
    assert "| tiny | 80 | 0: full_attention | pin | 6 | ACCEPTED | 16 | 512 |" in results
