"""kvhint-conformance: run the kvhint.v1 conformance suite against one engine.

    kvhint-conformance --target HOST:PORT --openai-url http://HOST:PORT [options]
    python -m conformance --target ... --openai-url ...

Exit status: 0 when every selected case passed or was skipped (or failed and is listed in
--known-failing), 1 when a case failed or a --known-failing entry passed (stale), 2 on a usage
error, 3 when the target does not answer or refuses the token (no case runs). See
conformance/README.md.
"""

from __future__ import annotations

import argparse
import fnmatch
import math
import os
import re
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

import grpc

from kvhint.v1 import kvhint_pb2 as pb

from .cases import REGISTRY
from .cases.requirements import CASE_OF_NEED
from .model import RELEASE, SUITE, Case, CaseFailed, CaseResult, CaseSkipped, Registry, Status
from .profiles import DEFAULT as DEFAULT_PROFILE
from .profiles import PROFILES
from .report import RunInfo, junit_xml, one_line, summary
from .target import CaseContext, Options, Target

EXIT_UNREACHABLE = 3
# Answers to GetCapabilities after which every case would fail the same way.
_NO_TARGET = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAUTHENTICATED)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="kvhint-conformance",
        description=f"Black-box conformance suite for engines that serve {SUITE} ({RELEASE}).",
    )
    p.add_argument("--target", metavar="HOST:PORT", help="the engine's kvhint.v1 gRPC endpoint")
    p.add_argument("--openai-url", metavar="URL", help="the engine's OpenAI-compatible HTTP endpoint (base URL)")
    p.add_argument("--model", help="model name for /v1/completions (default: the first of /v1/models)")
    p.add_argument("--profile", choices=sorted(PROFILES), default=DEFAULT_PROFILE,
                   help="the conformance profile claimed: its actions must be advertised, and cases needing them fail "
                        f"instead of skipping (default {DEFAULT_PROFILE}; " +
                        "; ".join(f"{p.name}: {p.summary}" for p in PROFILES.values()) + ")")
    p.add_argument("--max-model-len", type=int, default=1024,
                   help="longest prompt + completion the endpoint accepts (default 1024)")
    p.add_argument("--token-range", default="3:4000", metavar="LOW:HIGH",
                   help="token ids used for synthetic prompts, [LOW, HIGH) (default 3:4000)")
    p.add_argument("--max-pressure-prompts", type=int, default=64,
                   help="most filler prompts one pressure round may take (default 64)")
    p.add_argument("--max-window-rpcs", type=int, default=1000,
                   help="most ApplyHints batches used to pass the event replay window (default 1000)")
    p.add_argument("--rpc-timeout", type=float, default=30.0, help="per-RPC deadline in seconds (default 30)")
    p.add_argument("--tie-nats", type=float, default=Options.tie_nats, metavar="NATS",
                   help="greedy candidates this close in logprob are a numerical tie: a few ulps of the engine's "
                        "logits in its compute dtype (default 2**-4, 8 bfloat16 ulps of a logit in [1, 2); "
                        "1e-3 suits a float32 engine)")
    p.add_argument("--run", action="append", default=[], metavar="REGEX",
                   help="only cases whose id matches (re.search); repeatable")
    p.add_argument("--skip", action="append", default=[], metavar="REGEX",
                   help="leave out cases whose id matches; repeatable")
    p.add_argument("--known-failing", metavar="FILE",
                   help="case ids (or globs) expected to fail, one per line, '#' comments; a listed case that "
                        "passes fails the run as stale")
    p.add_argument("--junit-xml", metavar="FILE", help="also write a JUnit XML report")
    p.add_argument("--list", action="store_true", help="print the selected case ids and exit")
    p.add_argument("--describe", action="store_true", help="print the selected cases (id, requires, statement) and exit")
    p.add_argument("-v", "--verbose", action="store_true", help="print every case's result as it finishes")
    p.add_argument("--token", help="bearer token sent on every RPC (with tenants: an admin's)")
    for t in ("a", "b"):
        p.add_argument(f"--tenant-{t}-token", help=f"tenancy cases: tenant {t.upper()}'s bearer token")
        p.add_argument(f"--tenant-{t}-prefix", help=f"tenancy cases: tenant {t.upper()}'s session-id prefix")
    p.add_argument("--nonce", help="run nonce used in session ids and prompts (default: random)")
    args = p.parse_args(argv)
    if not (args.list or args.describe) and not args.target:
        p.error("--target is required")
    try:
        low, high = (int(x) for x in args.token_range.split(":"))
        if not 0 <= low < high:
            raise ValueError
    except ValueError:
        p.error(f"--token-range {args.token_range!r}: expected LOW:HIGH with 0 <= LOW < HIGH")
    for option, patterns in (("--run", args.run), ("--skip", args.skip)):
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as exc:
                p.error(f"{option} {pattern!r}: not a regular expression ({exc})")
    args.token_low, args.token_high = low, high
    if not (math.isfinite(args.tie_nats) and args.tie_nats >= 0):
        p.error(f"--tie-nats {args.tie_nats!r}: expected a finite number of nats >= 0")
    return args


def select(registry: Registry, run: Sequence[str], skip: Sequence[str]) -> list[Case]:
    """The cases --run/--skip select, in registry order, plus the `requirements/*` case of every
    need a selected case has (model.py, `needs`): a case whose need is unmet is SKIPPED, and the
    requirement's case FAILS, so a filtered run (`--run retention/` without --openai-url) cannot
    pass having checked nothing. Bad patterns raise re.error."""
    runs = [re.compile(r) for r in run]
    skips = [re.compile(r) for r in skip]
    chosen = {
        c.id for c in registry.cases
        if (not runs or any(r.search(c.id) for r in runs)) and not any(s.search(c.id) for s in skips)
    }
    required = {f"{SUITE}/requirements/{CASE_OF_NEED[n]}" for c in registry.cases if c.id in chosen for n in c.needs}
    return [c for c in registry.cases if c.id in chosen or c.id in required]


def parse_known_failing(text: str) -> list[str]:
    """The case ids (or globs) of a known-failing file: one per line, `#` starts a comment."""
    return [line for line in (raw.split("#", 1)[0].strip() for raw in text.splitlines()) if line]


def read_known_failing(path: str, registry: Registry) -> list[str]:
    """Patterns from a known-failing file. Every pattern must match a registered case."""
    patterns = parse_known_failing(Path(path).read_text())
    ids = registry.ids()
    unknown = [p for p in patterns if not any(fnmatch.fnmatchcase(i, p) for i in ids)]
    if unknown:
        raise SystemExit(f"kvhint-conformance: --known-failing entries match no case: {', '.join(unknown)}")
    return patterns


def run_case(target: Target, case: Case, index: int) -> CaseResult:
    start = time.monotonic()
    ctx: CaseContext | None = None
    try:
        missing = target.missing_capabilities(case)
        gaps = target.profile_gaps(missing)
        if gaps:
            return CaseResult(case, Status.FAILED, f"the '{target.options.profile}' profile requires {', '.join(gaps)}, "
                                                   "which the target does not advertise")
        if missing:
            return CaseResult(case, Status.SKIPPED, f"not advertised by the target: {', '.join(missing)}")
        for need in case.needs:
            ok, reason = target.need(need)
            if not ok:
                return CaseResult(case, Status.SKIPPED, f"requirement {need!r} not met: {reason}")
        ctx = CaseContext(target, case, index)
        case.run(ctx)
        return CaseResult(case, Status.PASSED, details="\n".join(ctx.notes))
    except CaseSkipped as exc:
        return CaseResult(case, Status.SKIPPED, str(exc) or "skipped")
    except (CaseFailed, AssertionError) as exc:
        return CaseResult(case, Status.FAILED, str(exc) or type(exc).__name__, details=traceback.format_exc())
    except Exception as exc:  # noqa: BLE001 - any error fails the case, not the run
        return CaseResult(case, Status.FAILED, f"error: {type(exc).__name__}: {exc}", details=traceback.format_exc())
    finally:
        if ctx is not None:
            try:
                ctx.cleanup()
            except Exception:  # noqa: BLE001
                pass


def apply_known_failing(result: CaseResult, patterns: Sequence[str]) -> CaseResult:
    if not any(fnmatch.fnmatchcase(result.case.id, p) for p in patterns):
        return result
    if result.status is Status.FAILED:
        result.status = Status.KNOWN_FAILING
    elif result.status is Status.PASSED:
        result.status = Status.STALE
        result.reason = "listed in --known-failing but passed: remove it from the list"
    return result


def run_suite(options: Options, cases: Sequence[Case], known_failing: Sequence[str] = (),
              out: TextIO | None = None, verbose: bool = False) -> tuple[list[CaseResult], RunInfo]:
    target = Target(options)
    started = time.monotonic()
    results: list[CaseResult] = []
    try:
        for index, case in enumerate(cases):
            case_started = time.monotonic()
            result = run_case(target, case, index)
            result.duration_s = time.monotonic() - case_started
            result = apply_known_failing(result, known_failing)
            results.append(result)
            if out is not None and (verbose or result.failed):
                label = result.status.value.upper()
                reason = f": {one_line(result.reason, 200)}" if result.reason else ""
                print(f"{label:13} {case.id} ({result.duration_s:.2f}s){reason}", file=out, flush=True)
        engine, epoch, plan = "", "", ""
        try:
            caps = target.caps
            engine, epoch = f"{caps.engine} {caps.engine_version}".strip(), caps.epoch
            plan = target.plan.summary()
        except Exception:  # noqa: BLE001
            pass
        info = RunInfo(options.target, options.openai_url or "", engine, epoch, plan, time.monotonic() - started, options.nonce,
                       options.profile)
    finally:
        target.close()
    return results, info


def preflight(options: Options) -> str | None:
    """Why no case can run: the target does not answer GetCapabilities within the RPC deadline
    (waiting for it to be ready, as the cases do, so an engine still starting is waited for), or
    refuses the token. None when it answers, or fails otherwise (the cases then report that).
    A mistyped --target was 134 failed cases, each a DEADLINE_EXCEEDED."""
    target = Target(options)
    request = pb.GetCapabilitiesRequest()
    try:
        target.stub.GetCapabilities(request, timeout=options.rpc_timeout, wait_for_ready=True)
        return None
    except grpc.RpcError as err:
        code, detail = err.code(), err.details()
        if code not in _NO_TARGET:
            return None
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            try:  # without waiting: the transport's own error (connection refused, no route ...)
                target.stub.GetCapabilities(request, timeout=min(2.0, options.rpc_timeout))
                return None
            except grpc.RpcError as again:
                code, detail = again.code(), again.details()
        if code is grpc.StatusCode.UNAUTHENTICATED:
            return f"the target {options.target} refused the credentials (--token): {detail}"
        return (f"cannot reach the target {options.target}: no answer to GetCapabilities within "
                f"{options.rpc_timeout:g}s ({code.name}: {one_line(detail or '', 200)})")
    finally:
        target.close()


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    try:
        args = parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0) if isinstance(exc.code, int) else 2
    cases = select(REGISTRY, args.run, args.skip)
    if args.list or args.describe:
        try:
            for c in cases:
                if args.list:
                    print(c.id, file=out)
                    continue
                requires = f" [requires {', '.join(c.requires)}]" if c.requires else ""
                needs = f" [needs {', '.join(c.needs)}]" if c.needs else ""
                print(f"{c.id} (since {c.since}){requires}{needs}\n    {c.statement}", file=out)
            out.flush()
        except BrokenPipeError:  # `kvhint-conformance --list | head`: quiet exit
            if out is sys.stdout:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    try:
        known = read_known_failing(args.known_failing, REGISTRY) if args.known_failing else []
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return 2
    except (OSError, UnicodeDecodeError) as exc:
        print(f"kvhint-conformance: --known-failing {args.known_failing}: {exc}", file=sys.stderr)
        return 2
    if not cases:
        print("kvhint-conformance: no case matches --run/--skip", file=sys.stderr)
        return 2
    kw = {"nonce": args.nonce} if args.nonce else {}
    options = Options(
        target=args.target, openai_url=args.openai_url, model=args.model, max_model_len=args.max_model_len,
        token_low=args.token_low, token_high=args.token_high, max_pressure_prompts=args.max_pressure_prompts,
        max_window_rpcs=args.max_window_rpcs, rpc_timeout=args.rpc_timeout, tie_nats=args.tie_nats, profile=args.profile,
        token=args.token, tenant_a_token=args.tenant_a_token, tenant_a_prefix=args.tenant_a_prefix,
        tenant_b_token=args.tenant_b_token, tenant_b_prefix=args.tenant_b_prefix, **kw,
    )
    started = time.monotonic()
    unreachable = preflight(options)
    if unreachable:
        print(f"kvhint-conformance: {unreachable}; no case was run", file=sys.stderr)
        if args.junit_xml:  # a CI job's report still shows every selected case failed, and why
            results = [CaseResult(c, Status.FAILED, f"not run: {unreachable}") for c in cases]
            info = RunInfo(options.target, options.openai_url or "", "", "", "", time.monotonic() - started,
                           options.nonce, options.profile)
            Path(args.junit_xml).write_bytes(junit_xml(results, info))
        return EXIT_UNREACHABLE
    results, info = run_suite(options, cases, known, out=out, verbose=args.verbose)
    print(summary(results, info), file=out, flush=True)
    if args.junit_xml:
        Path(args.junit_xml).write_bytes(junit_xml(results, info))
    return 1 if any(r.failed for r in results) else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
