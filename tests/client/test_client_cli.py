"""The `kvhint` CLI against the fake server: exit codes 0/1/2/3/4, one-line error messages, and
parseable --json output. Most cases call `kvhint_client.cli.main(argv)` in this process (what the
console script calls, with the real stdin, stdout and stderr swapped for strings); the
`python -m kvhint_client.cli` entry point itself runs as a subprocess in the tests that say so."""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import grpc
from fake_kvhint_server import HANG, RunningServer, h, heartbeat, resync, snapshot, stored

from kvhint.v1 import kvhint_pb2
from kvhint_client import cli

REPO = Path(__file__).resolve().parents[2]


def kvhint(*args: str, address: str | None = None, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run the CLI in this process; the result reads like a finished subprocess."""
    argv = (["--address", address] if address is not None else []) + list(args)
    out, err = io.StringIO(), io.StringIO()
    saved_stdin, saved_address = sys.stdin, os.environ.pop("KVHINT_ADDRESS", None)
    sys.stdin = io.StringIO(stdin or "")
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(argv)
    finally:
        sys.stdin = saved_stdin
        if saved_address is not None:
            os.environ["KVHINT_ADDRESS"] = saved_address
    return subprocess.CompletedProcess(["kvhint", *argv], code, out.getvalue(), err.getvalue())


def kvhint_subprocess(*args: str, address: str | None = None, stdin: str | None = None, timeout: float = 60):
    """`python -m kvhint_client.cli` as a subprocess."""
    argv = [sys.executable, "-m", "kvhint_client.cli"]
    if address is not None:
        argv += ["--address", address]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("KVHINT_ADDRESS", None)
    return subprocess.run(argv + list(args), capture_output=True, text=True, input=stdin, cwd=REPO, env=env,
                          timeout=timeout)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_apply_pin_accepted_exit_0_and_json(fake: RunningServer) -> None:
    run = kvhint_subprocess("apply", "pin", "--session", "S", "--ttl", "30", "--hint-id", "h1", "--json", address=fake.address)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["all_accepted"] is True and out["results"][0]["outcome"] == "OUTCOME_ACCEPTED"
    assert out["results"][0]["hint_id"] == "h1" and out["epoch"] == "E1"
    sent = fake.servicer.applied[0]
    assert sent.pin.ttl.seconds == 30 and sent.selector.session.session_id == "S"


def test_apply_flags_build_the_hint(fake: RunningServer) -> None:
    run = kvhint("--address", fake.address, "apply", "retain", "--session", "S", "--include-children",
                 "--range", "2:", "--priority", "5", "--ttl", "1.5", "--max-blocks", "9")
    assert run.returncode == 0, run.stderr
    assert "ACCEPTED" in run.stdout and "HINT" in run.stdout
    sent = fake.servicer.applied[0]
    assert sent.selector.session.include_children and sent.selector.range.start == 2
    assert not sent.selector.range.HasField("end")
    assert (sent.retain.priority, sent.retain.ttl.nanos, sent.max_blocks) == (5, 500_000_000, 9)
    run = kvhint("apply", "evict", "--block-hash", "00ff", "--block-hash", "0a", address=fake.address)
    assert list(fake.servicer.applied[1].selector.block_hashes.block_hashes) == [b"\x00\xff", b"\x0a"]


def test_apply_not_accepted_exit_1(fake: RunningServer) -> None:
    fake.servicer.outcome_for = lambda hint: kvhint_pb2.HintResult(
        hint_id=hint.hint_id, outcome=kvhint_pb2.OUTCOME_REJECTED, reason=kvhint_pb2.REASON_UNSUPPORTED,
        message="no lower tier")
    run = kvhint("apply", "demote", "--continuation", "c1", "--target-tier", "host", address=fake.address)
    assert run.returncode == 1
    assert "REJECTED" in run.stdout and "UNSUPPORTED" in run.stdout and "no lower tier" in run.stdout


def _deferred(fake: RunningServer, *states: int) -> None:
    fake.servicer.outcome_for = lambda hint: kvhint_pb2.HintResult(
        hint_id=hint.hint_id, outcome=kvhint_pb2.OUTCOME_DEFERRED, operation_id="op-1")
    fake.servicer.operations["op-1"] = list(states)


def test_a_deferred_demote_is_exit_1_without_wait_and_0_once_its_operation_succeeded(fake: RunningServer) -> None:
    """DEFERRED is a Demote's normal answer: `kvhint apply demote && ...` always took the failure
    branch, and the CLI had no way to see the operation end. --wait polls it."""
    S = kvhint_pb2.Operation
    _deferred(fake, S.STATE_PENDING, S.STATE_RUNNING, S.STATE_SUCCEEDED)
    assert kvhint("apply", "demote", "--session", "s", address=fake.address).returncode == 1
    run = kvhint("apply", "demote", "--session", "s", "--wait", "10", address=fake.address)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "DEFERRED" in run.stdout and "op-1" in run.stdout and "SUCCEEDED" in run.stdout
    _deferred(fake, S.STATE_RUNNING, S.STATE_SUCCEEDED)
    run = kvhint("apply", "demote", "--session", "s", "--wait", "10", "--json", address=fake.address)
    out = json.loads(run.stdout)
    assert run.returncode == 0 and [op["state"] for op in out["operations"]] == ["STATE_SUCCEEDED"]


def test_a_deferred_operation_that_fails_or_outlasts_the_wait_is_exit_1(fake: RunningServer) -> None:
    S = kvhint_pb2.Operation
    _deferred(fake, S.STATE_RUNNING, S.STATE_FAILED)
    run = kvhint("apply", "demote", "--session", "s", "--wait", "10", address=fake.address)
    assert run.returncode == 1 and "FAILED" in run.stdout
    _deferred(fake, S.STATE_RUNNING)
    run = kvhint("apply", "demote", "--session", "s", "--wait", "0.5", address=fake.address)
    assert run.returncode == 1 and "RUNNING" in run.stdout and "not finished after --wait 0.5s" in run.stdout
    for bad in ("0", "-1", "nan"):
        assert kvhint("apply", "demote", "--session", "s", "--wait", bad, address=fake.address).returncode == 2


def test_apply_envelope_from_stdin(fake: RunningServer) -> None:
    envelope = {"protocol_version": "0.1", "message_id": "m", "actions": [
        {"action_id": "a", "action_type": "kv.share", "action_version": "1.0",
         "payload": {"selector": {"session_id": "S"}, "destination": "peer:1"}}]}
    run = kvhint_subprocess("apply", "--envelope", "-", "--json", address=fake.address, stdin=json.dumps(envelope))
    assert run.returncode == 0, run.stderr
    assert fake.servicer.applied[0].share.destination == "peer:1"
    bad = dict(envelope, actions=[dict(envelope["actions"][0], action_type="kv.fetch")])
    run = kvhint_subprocess("apply", "--envelope", "-", address=fake.address, stdin=json.dumps(bad))
    assert run.returncode == 2 and "unsupported action_type 'kv.fetch'" in run.stderr


def test_usage_errors_exit_2_without_calling_the_server(fake: RunningServer) -> None:
    cases = [
        (["apply", "pin", "--session", "S"], "pin needs --ttl"),
        (["apply", "pin", "--ttl", "3"], "give exactly one selector"),
        (["apply", "pin", "--session", "S", "--continuation", "c", "--ttl", "3"], "got --session, --continuation"),
        (["apply", "evict", "--session", "S", "--ttl", "3"], "--ttl does not apply to evict"),
        (["apply", "pin", "--session", "S", "--ttl", "0"], "ttl must be > 0"),
        (["apply", "evict", "--block-hash", "xyz"], "not hexadecimal"),
        (["apply", "evict", "--session", "S", "--range", "4:2"], "greater than start"),
        (["apply", "teleport", "--session", "S"], "invalid choice"),
        (["apply"], "choose an action"),
        (["watch", "--resume", "nonsense"], "--resume must look like EPOCH:SEQ"),
        (["residency", "--session", "S", "--tier", "ssd"], "unknown tier"),
        (["frobnicate"], "invalid choice"),
        (["capabilities", "--ca-cert", "/nonexistent/ca.pem"], "--ca-cert /nonexistent/ca.pem: no such file"),
        (["capabilities", "--timeout", "0"], "--timeout must be a finite number of seconds > 0"),
        (["capabilities", "--timeout", "nan"], "--timeout must be a finite number of seconds > 0"),
        (["capabilities", "--timeout", "inf"], "--timeout must be a finite number of seconds > 0"),
        (["capabilities", "--timeout", "1e10"], "--timeout must be a finite number of seconds > 0 and at most 2147483648"),
        (["apply", "pin", "--session", "S", "--ttl", "1e20"], "out of range"),
        (["watch", "--heartbeat", "1e20", "--count", "1"], "out of range"),
        (["watch", "--duration", "-1"], "--duration must be a finite number of seconds > 0"),
        (["watch", "--duration", "nan"], "--duration must be a finite number of seconds > 0"),
        (["sessions", "--page-size", "99999999999"], "--page-size must be in 0..4294967295"),
        (["residency", "--session", "S", "--page-size", "-1"], "--page-size must be in"),
        (["apply", "--envelope", "-"], "envelope: it has no actions"),
        (["apply", "--envelope", "-", "--max-blocks", "3"], "--max-blocks does not apply with --envelope"),
        (["apply", "--envelope", "-", "--session", "S", "--ttl", "5"], "--session, --ttl does not apply with --envelope"),
        (["watch", "--resume", "E1:-5"], "--resume sequence must be in 0..18446744073709551615"),
        (["watch", "--resume", f"E1:{2**64}"], "--resume sequence must be in 0..18446744073709551615"),
    ]
    stdin = json.dumps({"protocol_version": "0.1", "message_id": "x", "actions": []})
    watched = fake.servicer.count("WatchEvents")  # the fixture's server is shared with other tests
    for args, message in cases:
        run = kvhint(*args, address=fake.address, stdin=stdin)
        assert run.returncode == 2, (args, run.stdout, run.stderr)
        assert message in run.stderr, (args, run.stderr)
    run = kvhint_subprocess(*cases[0][0], address=fake.address)  # the same through the entry point
    assert run.returncode == 2 and cases[0][1] in run.stderr, run.stderr
    run = kvhint("sessions", address="")
    assert run.returncode == 2 and "address must not be empty" in run.stderr, run.stderr
    assert fake.servicer.count("ApplyHints") == 0 and fake.servicer.count("WatchEvents") == watched


def test_an_envelope_file_that_is_not_utf8_is_a_usage_error(fake: RunningServer, tmp_path: Path) -> None:
    envelope = tmp_path / "e.json"
    envelope.write_text(json.dumps({"protocol_version": "0.1", "message_id": "x", "actions": []}), encoding="utf-16")
    run = kvhint("apply", "--envelope", str(envelope), address=fake.address)
    assert run.returncode == 2 and "not UTF-8 JSON" in run.stderr, run.stderr


def test_an_envelope_with_an_overflowing_number_or_deep_nesting_is_a_usage_error(fake: RunningServer) -> None:
    action = {"action_id": "a", "action_type": "kv.pin", "action_version": "1.0",
              "payload": {"selector": {"session_id": "S"}, "ttl_seconds": "1e999999"}}
    overflowing = json.dumps({"protocol_version": "0.1", "message_id": "m", "actions": [action]})
    nested = "[" * 100_000 + "]" * 100_000
    too_long = ("kvhint: envelope: action 0 (id 'a'), kv.pin: ttl_seconds must be at most 315576000000 seconds "
                "(google.protobuf.Duration's range), got '1e999999'")
    for stdin, message in ((overflowing, too_long),
                           (nested, "kvhint: envelope -: not valid JSON (nested too deeply)")):
        run = kvhint("apply", "--envelope", "-", address=fake.address, stdin=stdin)
        assert run.returncode == 2 and run.stderr.strip().splitlines() == [message], run.stderr
    assert fake.servicer.count("ApplyHints") == 0


def test_a_token_that_is_not_a_header_value_is_a_usage_error(fake: RunningServer) -> None:
    for token in ("tok\r", "line\nbreak", "caf\u00e9"):
        run = kvhint("capabilities", "--token", token, address=fake.address)
        assert run.returncode == 2 and "--token / $KVHINT_TOKEN must be printable ASCII" in run.stderr, run.stderr
    assert fake.servicer.count("GetCapabilities") == 0
    assert kvhint("capabilities", "--token", "a-token_with.ok~chars", address=fake.address).returncode == 0


def test_invalid_argument_from_server_exit_2_with_reason_and_field(fake: RunningServer) -> None:
    fake.servicer.abort["ApplyHints"] = (grpc.StatusCode.INVALID_ARGUMENT, "session_id too long",
                                         "REASON_MALFORMED_REQUEST", {"field": "hints[0].selector.session.session_id"})
    run = kvhint("apply", "release", "--session", "S", address=fake.address)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0] == ("kvhint: invalid argument: session_id too long (reason REASON_MALFORMED_REQUEST, "
                        "field hints[0].selector.session.session_id)")


def test_connection_refused_exit_3() -> None:
    run = kvhint_subprocess("capabilities", "--retries", "0", address=f"127.0.0.1:{free_port()}")
    assert run.returncode == 3
    assert run.stderr.strip().endswith("connection refused") and len(run.stderr.strip().splitlines()) == 1


def test_deadline_exceeded_exit_3(fake: RunningServer) -> None:
    fake.servicer.delay["GetCapabilities"] = 2.0
    run = kvhint("capabilities", "--timeout", "0.3", address=fake.address)
    assert run.returncode == 3
    assert "deadline exceeded" in run.stderr and "GetCapabilities" in run.stderr and "0.3s" in run.stderr


def test_other_server_errors_exit_4(fake: RunningServer) -> None:
    fake.servicer.fail_next["ListSessions"] = [grpc.StatusCode.PERMISSION_DENIED]
    run = kvhint("sessions", address=fake.address)
    assert run.returncode == 4 and "ListSessions failed: PERMISSION_DENIED" in run.stderr


def test_health_exit_codes(fake: RunningServer) -> None:
    run = kvhint("health", "--json", address=fake.address)
    assert run.returncode == 0 and json.loads(run.stdout)["serving"] is True
    from grpc_health.v1 import health_pb2

    fake.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    run = kvhint("health", address=fake.address)
    assert run.returncode == 1 and "NOT_SERVING" in run.stdout


def test_residency_and_sessions_json(fake: RunningServer) -> None:
    fake.servicer.blocks = [kvhint_pb2.BlockInfo(block_hash=h(i), position=i, tiers=[kvhint_pb2.TIER_DEVICE],
                                                 session_ids=["S"]) for i in range(3)]
    fake.servicer.sessions = [kvhint_pb2.SessionInfo(session_id="S", frontier_hashes=[h(2)],
                                                     blocks=[kvhint_pb2.TierBlockCount(tier=1, blocks=3)])]
    run = kvhint("residency", "--session", "S", "--page-size", "2", "--json", address=fake.address)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert [b["block_hash"] for b in out["blocks"]] == [h(i).hex() for i in range(3)]
    assert out["totals"] == [{"tier": "TIER_DEVICE", "blocks": 3}] and out["as_of_sequence"] == 100
    run = kvhint("sessions", "--json", address=fake.address)
    session_out = json.loads(run.stdout)["sessions"][0]
    assert session_out["frontier_hashes"] == [h(2).hex()] and session_out["blocks"][0]["tier"] == "TIER_DEVICE"
    human = kvhint("residency", "--session", "S", address=fake.address)
    assert h(1).hex() in human.stdout and "3 blocks; totals device=3" in human.stdout


def test_capabilities_human_and_json(fake: RunningServer) -> None:
    run = kvhint("capabilities", address=fake.address)
    assert run.returncode == 0 and "fake 0.0" in run.stdout and "pin" in run.stdout
    fake.servicer.capabilities.limits.max_hints_per_batch = 256
    fake.servicer.capabilities.limits.max_block_hashes_per_selector = 4096
    fake.servicer.capabilities.limits.max_block_hashes_per_batch = 8192
    assert "256 hints, 4096 hashes per selector, 8192 in all" in kvhint("capabilities", address=fake.address).stdout
    caps = json.loads(kvhint("capabilities", "--json", address=fake.address).stdout)
    assert caps["engine"] == "fake" and caps["num_device_blocks"] == 128


def test_watch_json_lines_and_resync_exit_1(fake: RunningServer) -> None:
    fake.servicer.watch_scripts = [[*snapshot("E1", 4, {"S": [(1, [1])]}), stored("E1", 5, [2], "S"),
                                    heartbeat("E1", 5), resync("E1", 5)]]
    run = kvhint("watch", "--from-snapshot", "--json", "--session", "S", "--kind", "blocks_stored",
                 address=fake.address)
    assert run.returncode == 1, run.stderr
    messages = [json.loads(line) for line in run.stdout.splitlines()]
    kinds = [next(k for k in m if k not in ("epoch", "sequence", "time")) for m in messages]
    assert kinds == ["snapshot_begin", "snapshot_chunk", "snapshot_end", "blocks_stored", "heartbeat", "resync"]
    assert messages[3]["blocks_stored"]["block_hashes"] == [h(2).hex()] and messages[3]["sequence"] == 5
    request = fake.servicer.watch_requests[0]
    assert request.start == kvhint_pb2.WatchEventsRequest.START_SNAPSHOT
    assert list(request.filter.session_ids) == ["S"]
    assert list(request.filter.kinds) == [kvhint_pb2.EVENT_KIND_BLOCKS_STORED]


def test_watch_count_and_resume(fake: RunningServer) -> None:
    fake.servicer.watch_scripts = [[heartbeat("E1", 8), stored("E1", 9, [3], "S"), stored("E1", 10, [4], "S"), HANG]]
    run = kvhint("watch", "--resume", "E1:8", "--count", "2", address=fake.address)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith("E1:9 ") and "BLOCKS_STORED" in lines[0], "heartbeats hidden"
    request = fake.servicer.watch_requests[0]
    assert (request.start, request.resume_epoch, request.resume_after_sequence) == (
        kvhint_pb2.WatchEventsRequest.START_RESUME, "E1", 8)


def test_watch_prints_membership_changes(fake: RunningServer) -> None:
    left = kvhint_pb2.MembershipChanged(session_id="S", block_hashes=[h(1), h(2)],
                                        cause=kvhint_pb2.MembershipChanged.CAUSE_RELEASED)
    fake.servicer.watch_scripts = [[kvhint_pb2.WatchEventsResponse(epoch="E1", sequence=9, membership_changed=left), HANG]]
    run = kvhint("watch", "--count", "1", address=fake.address)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"E1:9 - MEMBERSHIP_CHANGED session=S n=2 cause=released [{h(1).hex()},{h(2).hex()}]"


def test_values_a_newer_server_adds_print_as_numbers(fake: RunningServer) -> None:
    """proto3 enums are open: a cause, class, tier or selector kind this client does not know
    shows as its number instead of ending the command with a traceback."""
    fake.servicer.watch_scripts = [[
        kvhint_pb2.WatchEventsResponse(epoch="E1", sequence=9, blocks_removed=kvhint_pb2.BlocksRemoved(
            tier=kvhint_pb2.TIER_DEVICE, block_hashes=[h(1)], cause=42)),
        kvhint_pb2.WatchEventsResponse(epoch="E1", sequence=9, resync=kvhint_pb2.Resync(cause=43, current_epoch="E1")),
    ]]
    run = kvhint("watch", address=fake.address)
    assert run.returncode == 1, run.stderr
    lines = run.stdout.splitlines()
    assert "BLOCKS_REMOVED tier=device n=1 cause=42" in lines[0] and "RESYNC cause=43" in lines[1], run.stdout
    fake.servicer.blocks = [kvhint_pb2.BlockInfo(block_hash=h(1), tiers=[kvhint_pb2.TIER_DEVICE, 9],
                                                 retention=kvhint_pb2.RetentionState(retention_class=7))]
    run = kvhint("residency", "--session", "S", address=fake.address)
    assert run.returncode == 0 and "totals device=1 9=1" in run.stdout, run.stderr
    row = run.stdout.splitlines()[1].split()
    assert row[2:5] == ["device,9", "-", "7"], run.stdout  # TIERS, IN_USE, RETENTION (an unknown class)
    run = kvhint("residency", "--session", "S", "--json", address=fake.address)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["totals"] == [{"tier": "TIER_DEVICE", "blocks": 1}, {"tier": 9, "blocks": 1}]
    fake.servicer.capabilities.actions[0].selectors.append(9)
    run = kvhint("capabilities", address=fake.address)
    assert run.returncode == 0 and "session,9" in run.stdout, run.stderr


def test_bench_tool_errors_are_printed(tmp_path: Path) -> None:
    missing = tmp_path / "missing.jsonl"
    run = kvhint("bench", "run", "--trace", str(missing), "--out", str(tmp_path / "out"))
    assert run.returncode == 2
    assert "error" in run.stderr and str(missing) in run.stderr, run.stderr


def test_watch_duration_ends_a_quiet_stream(fake: RunningServer) -> None:
    run = kvhint("watch", "--duration", "0.5", "--json", address=fake.address)
    assert run.returncode == 0 and run.stdout == ""


def test_help_lists_commands_and_exit_codes() -> None:
    run = kvhint_subprocess("--help")
    assert run.returncode == 0
    for command in ("capabilities", "apply", "residency", "sessions", "watch", "health", "make-tiny-model"):
        assert command in run.stdout
    assert "3 unavailable" in run.stdout


def test_extra_command_modules_can_register(tmp_path: Path) -> None:
    module = tmp_path / "hello_cmd.py"
    module.write_text(
        "def register(subparsers, common):\n"
        "    p = subparsers.add_parser('hello', parents=[common])\n"
        "    p.set_defaults(run=lambda args, ctx: (ctx.print('hi ' + ctx.address), 0)[1])\n"
    )
    code = ("import sys; sys.path.insert(0, %r); from kvhint_client import cli; "
            "cli.COMMAND_MODULES.append('hello_cmd'); raise SystemExit(cli.main(['hello', '--address', 'x:1']))"
            % str(tmp_path))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert run.returncode == 0 and run.stdout.strip() == "hi x:1"


