#!/usr/bin/env python3
"""Mutation check: each mutant below must make the fast suite fail.

Each mutant is data: a file, a regular expression that must match exactly once
(the anchor), and its replacement. For every mutant the tool applies it, runs
the fast suite (`pytest -m "not engine" -x -q` over FAST_PATHS, tests/inproc
first so a killed mutant is found quickly), and restores the file. It prints a
table mutant -> killed/survived and exits 1 if any mutant survived, 2 if an
anchor no longer matches (the code moved: update the mutant, never drop it
silently) or the unmutated suite already fails (then no verdict means anything).

By default the work happens in a temporary copy of the working tree (tracked
and untracked, non-ignored files), so other people's runs in this checkout
never see a mutated file; `--in-place` mutates the checkout itself (the file is
always restored, in a `finally`). Either way only the mutant's own file is
touched.

  python3 tools/mutants.py                 # every mutant, the whole fast suite
  python3 tools/mutants.py --paths tests/inproc --only refile-noop
  python3 tools/mutants.py --list
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ANCHOR_TEST = "tests/unit/test_mutant_anchors.py::test_every_mutant_anchor_matches_its_file_once_and_changes_it"
FAST_PATHS = ("tests/inproc", "tests/unit", "tests/client", "tests/bench", "tests/conformance", "tests/stubs")


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    anchor: str  # regex, must match exactly once (re.MULTILINE | re.DOTALL off)
    replacement: str  # re.sub replacement (may use \1 ...)
    what: str


MUTANTS = (
    Mutant(
        "priority-reversed",
        "engine_integration/protected.py",
        r"for priority in sorted\(self\._retained\)",
        "for priority in sorted(self._retained, reverse=True)",
        "retained blocks are given up highest priority first",
    ),
    Mutant(
        "refile-noop",
        "engine_integration/hooks.py",
        r"(    def kvh_refile_block\(self[^\n]*\n(?:        \"\"\"(?:[^\"]|\"(?!\"\"))*\"\"\"\n)?)",
        r"\1        return\n",
        "kvh_refile_block does nothing: Pin and Retain protect nothing",
    ),
    Mutant(
        "sync-always-plain",
        "engine_integration/hooks.py",
        r"self\._kvh_retaining = bool\(",
        "self._kvh_retaining = False and bool(",
        "the pool turns its retention order off at every sync, grants in effect or not",
    ),
    Mutant(
        "sync-stays-retaining",
        "engine_integration/hooks.py",
        r"self\._kvh_retaining = bool\(",
        "self._kvh_retaining = True or bool(",
        "the pool keeps its retention order on once anything was retained (no longer straight to vLLM's own methods)",
    ),
    Mutant(
        "free-order-active",
        "engine_integration/hooks.py",
        r"mark = vllm_private\.queue_tail\(self\)\n            _free_blocks\(self, ordered_blocks\)\n",
        "mark = vllm_private.queue_tail(self)\n            _free_blocks(self, list(ordered_blocks)[::-1])\n",
        "free_blocks reverses vLLM's free order while a grant is in effect",
    ),
    Mutant(
        "grant-no-refile",
        "kvhint_server/executor.py",
        r"core\.adapter\.refile\(list\(reversed\(hashes\)\)\)",
        "pass",
        "the executor does not refile after a Pin/Retain grant",
    ),
    Mutant(
        "release-no-refile",
        "kvhint_server/executor.py",
        r"(if released:\n\s+)core\.adapter\.refile\(core\.tail_first\(released\)\)",
        r"\1pass",
        "the executor does not refile after a Release",
    ),
    Mutant(
        "expiry-no-refile",
        "kvhint_server/core.py",
        r"self\.adapter\.refile\(self\.tail_first\(expired\)\)",
        "pass",
        "expired grants are dropped from the ledger but their blocks stay protected",
    ),
    Mutant(
        "evict-ignores-in-use",
        "engine_integration/adapter.py",
        r"if any\(b\.ref_cnt > 0 for b in copies\):(\n\s+in_use\.append\(h\))",
        r"if False:\1",
        "Evict does not check whether a block is in use",
    ),
    Mutant(
        "protected-not-free",
        "engine_integration/hooks.py",
        r"return self\.free_block_queue\.num_free_blocks \+ self\._kvh_protected\.count",
        "return self.free_block_queue.num_free_blocks",
        "protected blocks are not counted free (the pool shrinks under retention)",
    ),
    Mutant(
        "fast-path-drops-removals",
        "engine_integration/hooks.py",
        r"self\._kvh\.on_keys_removed\(removed, self\._kvh_cause\)",
        "pass",
        "the allocation fast path does not report the blocks it evicts (KvHint's stream and index keep them resident)",
    ),
    Mutant(
        "fast-path-no-vllm-events",
        "engine_integration/hooks.py",
        r"if events:\n(\s+)_emit_removed\(self, evicted\)",
        r"if False:\n\1_emit_removed(self, evicted)",
        "the allocation fast path drops vLLM's own BlockRemoved events (vLLM's ZMQ stream misses evictions)",
    ),
    Mutant(
        "eviction-keeps-grants",
        "engine_integration/adapter.py",
        r"granted = self\.granted_keys\(popped\) if self\.core\.ledger\.grants else None",
        "granted = None",
        "an eviction ends no grant and unprotects no other copy (grants outlive their blocks)",
    ),
    Mutant(
        "eviction-keeps-copies-protected",
        "engine_integration/adapter.py",
        r"self\.unprotect_copies\(\[key\[:-4\] for key in granted\]\)",
        "pass",
        "an eviction ends its blocks' grants but leaves their other groups' copies protected",
    ),
    Mutant(
        "granted-removal-carried",
        "engine_integration/hooks.py",
        r"if carry is not None and not self\._kvh\.granted_keys\(removed\):",
        "if carry is not None:",
        "an allocation that evicts granted blocks carries their removal to the step's next report (their grants outlive them until then)",
    ),
    Mutant(
        "compat-ignored",
        "engine_integration/hooks.py",
        r"if \(retaining and self\._kvh_broken\) or not self\._kvh_fast_alloc:",
        "if retaining and self._kvh_broken:",
        "the allocation fast path runs on a vLLM whose get_new_blocks is not the one it repeats",
    ),
    Mutant(
        "free-walk-on-another-vllm",
        "engine_integration/hooks.py",
        r"if self\._kvh_tail_walk:",
        "if True:",
        "the free hook walks back from the queue's tail on a vLLM whose free_blocks may not put the freed blocks there",
    ),
    Mutant(
        "reset-strands-protected",
        "engine_integration/hooks.py",
        r"filings = \[\(block, protected\.filed_as\(block\)\) for block in protected\.blocks\(\)\] if protected\.count else \[\]",
        "filings = []",
        "a prefix-cache reset leaves the protected free blocks, hashless, outside vLLM's free queue",
    ),
    Mutant(
        "refused-reset-unfiled",
        "engine_integration/hooks.py",
        r"                self\._kvh_unqueue\(block\)\n                protected\.add\(block, cls, priority, reuse_at\)",
        "                pass",
        "a reset vLLM refuses leaves the protected blocks in its free queue, ordinary",
    ),
    Mutant(
        "bucket-lifo",
        "engine_integration/protected.py",
        r"plain_id = next\(iter\(self\.plain\), None\)",
        "plain_id = next(reversed(self.plain), None)",
        "within a priority, the chain's head is given up before its tail",
    ),
    Mutant(
        "bound-sessions-only",
        "kvhint_server/index.py",
        r"            elif over_blocks and key in self\.continuations:",
        "            elif False:",
        "the index's block bound forgets sessions only, never the continuations that hold blocks",
    ),
    Mutant(
        "owner-view-first-tie",
        "kvhint_server/retention.py",
        r"candidate\.cls == best\.cls and \(candidate\.priority, g\.expires_at\) > \(best\.priority, best\.expires_at or 0\.0\)",
        "candidate.cls == best.cls and candidate.priority > best.priority",
        "a session's protection ends with whichever equally strong grant comes first",
    ),
    Mutant(
        "page-token-fixed-limit",
        "kvhint_server/page_tokens.py",
        r"limit = MAX_TOKEN_CHARS if kind is int else self\.max_token_chars\(scope, key, max_len\)",
        "limit = MAX_TOKEN_CHARS",
        "page tokens issued for long session ids are refused as too long",
    ),
    Mutant(
        "index-join-emptied-set",
        "kvhint_server/index.py",
        r"                elif session not in m:  # type: ignore\[operator\]",
        "                elif m and session not in m:  # type: ignore[operator]",
        "a session joining a block whose member set was emptied is not recorded",
    ),
    Mutant(
        "index-admit-overwritten",
        "kvhint_server/index.py",
        r"(            else:\n                node\.tiers \|= bit\n)",
        r"\1                node.admit_session = session\n",
        "a block's admitting session is overwritten by every session that joins it",
    ),
    Mutant(
        "continuation-stays-listed",
        "kvhint_server/index.py",
        r"                state\.continuations\.discard\(c\)",
        "                pass",
        "a session keeps listing continuations the index forgot (its list grows with every one it named)",
    ),
    Mutant(
        "operation-history-counts-running",
        "kvhint_server/operations.py",
        r"        while len\(self\._finished\) > self\._history:",
        "        while self._finished and len(self._ops) > self._history:",
        "operations in flight take places of the finished-operation history (GetOperation: NOT_FOUND early)",
    ),
    Mutant(
        "tenant-retain-unpin-forgotten",
        "kvhint_server/tenant_guard.py",
        r"                    unpinned\.append\(h\)",
        "                    pass",
        "a Retain the window-tail trim left off a pinned block stops counting it against the tenant's pin budget",
    ),
    Mutant(
        "tenant-members-cut-first",
        "kvhint_server/tenant_guard.py",
        r"        if len\(v\.sessions\) >= cap and",
        "        if False and",
        "a widely shared block lists none of the tenant's own sessions once other tenants fill the member cap",
    ),
    Mutant(
        "window-tail-unknown-skips-groups",
        "kvhint_server/window_tails.py",
        r"                    break  # the chain above is unknown here: this group's window is not judged",
        "                    return True",
        "an ancestor the index does not know leaves every later window group unjudged (a clipped hint keeps blocks no resume hits)",
    ),
    Mutant(
        "follower-heartbeat-unchecked",
        "kvhint_client/follower.py",
        r"        to_duration\(heartbeat, name=\"heartbeat\"\)",
        "        pass",
        "a follower built with a heartbeat no subscription accepts starts, and never syncs",
    ),
    Mutant(
        "async-follower-stop-lost",
        "kvhint_client/follower.py",
        r"                        if self\._stopping:\n                            # stop\(\) cancelled this task",
        "                        if False:\n                            # stop() cancelled this task",
        "AsyncEventFollower.stop() hangs when a message arrives with the cancellation (Python < 3.12)",
    ),
    Mutant(
        "fleet-async-follower-kept",
        "kvhint_client/fleet.py",
        r"        if isinstance\(follower, \(EventFollower, AsyncEventFollower\)\):",
        "        if isinstance(follower, EventFollower):",
        "FleetClient keeps an AsyncEventFollower instead of its index, and apply() fails",
    ),
    Mutant(
        "client-ids-over-limit",
        "kvhint_client/_rpc.py",
        r"    if max_length and len\(hint_id\) > max_length:",
        "    if False:",
        "the ids the client gives hints are 36-byte uuid4s whatever the server's max_hint_id_length",
    ),
    Mutant(
        "fleet-ids-over-limit",
        "kvhint_client/fleet.py",
        r"prepare_hints\(hints, self\._id_limits\(\)\)",
        "prepare_hints(hints)",
        "FleetClient gives hints 36-byte ids whatever its engines' max_hint_id_length",
    ),
    Mutant(
        "duration-range-unchecked",
        "kvhint_client/durations.py",
        r"    if abs\(seconds\) >= MAX_DURATION_SECONDS \+ 1:",
        "    if False:",
        "builders send Durations past protobuf's range, which the server rejects as malformed",
    ),
    Mutant(
        "float-subclass-repr",
        "kvhint_client/durations.py",
        r"Decimal\(repr\(float\(value\)\)\)\.quantize",
        "Decimal(repr(value)).quantize",
        "numpy.float64 seconds are refused as out of range",
    ),
    Mutant(
        "query-charged-before-validation",
        "kvhint_server/servicer.py",
        r"        selector = parse_query_selector\(request\.selector",
        "        self._rate_limit(context, 1)\n        selector = parse_query_selector(request.selector",
        "a malformed QueryResidency spends a rate-limit token, and comes back RESOURCE_EXHAUSTED once they are spent",
    ),
    Mutant(
        "queue-full-token-kept",
        "kvhint_server/servicer.py",
        r"            self\._give_back\(principal, cost\)  # refused at once",
        "            pass  # refused at once",
        "a call the full queue refused keeps its rate-limit token spent",
    ),
    Mutant(
        "watch-gauge-live-only",
        "kvhint_server/watch.py",
        r"return max\(self\._open, len\(subs\)\),",
        "return len(subs),",
        "kvhint_watch_subscribers leaves out streams still taking their snapshot",
    ),
    Mutant(
        "member-hit-drops-continuation",
        "engine_integration/adapter.py",
        r"        if coords\.session_id and not coords\.continuation_id and self\._is_member\(",
        "        if coords.session_id and self._is_member(",
        "a member session's request that stores no full block leaves the continuation it names unrecorded",
    ),
    Mutant(
        "envelope-parser-error-escapes",
        "engine_integration/envelope_hints.py",
        r"    except Exception as exc:  # noqa: BLE001 - a payload the parser trips on",
        "    except ZeroDivisionError as exc:  # noqa: BLE001 - a payload the parser trips on",
        "an envelope the parser trips on raises out of add_request (EngineCore ends)",
    ),
    Mutant(
        "coords-surrogate-raises",
        "engine_integration/coords.py",
        r"        except UnicodeEncodeError:  # a lone surrogate",
        "        except ZeroDivisionError:  # a lone surrogate",
        "a session id that is not UTF-8 text raises inside vLLM's cache_full_blocks",
    ),
    Mutant(
        "envelope-one-bad-hash-typeerror",
        "kvhint_client/envelope.py",
        r"        target = blocks\(hashes\)  # \(one list",
        "        target = blocks(*hashes)  # (one list",
        "an envelope's block_hashes of one item that is a list is taken for the list of hashes",
    ),
    Mutant(
        "tier-unsent-store-kept",
        "engine_integration/tiers/control.py",
        r"            op\._stale = True\n            self\._drop_if_unsent\(job_id, op\)",
        "            op._stale = True",
        "a Demote's store not yet sent at a connector reset is sent after it, over chunks the reset tier gave out",
    ),
    Mutant(
        "prefetch-hit-is-progress",
        "engine_integration/tiers/operations.py",
        r"            if pf\.promoted_copies:\n                op\.full_since = None",
        "            if pf.hits:\n                op.full_since = None",
        "a hybrid Prefetch whose window copies find no host room runs to its deadline",
    ),
    Mutant(
        "expiry-refiles-root-first",
        "kvhint_server/core.py",
        r"self\.adapter\.refile\(self\.tail_first\(expired\)\)",
        "self.adapter.refile(expired)",
        "an expired grant's chain joins another owner's bucket root first (the root goes first)",
    ),
    Mutant(
        "refile-ordinary-in-given-order",
        "engine_integration/adapter.py",
        r"        for copies, view in reversed\(ordinary\):",
        "        for copies, view in ordinary:",
        "blocks that become ordinary reach the free queue's front root last (the root goes first)",
    ),
    # Session 51: fixes from a new user's trial and the reach review's leftovers.
    Mutant(
        "release-keeps-continuation-grants",
        "kvhint_server/executor.py",
        r"            owners \+= \[CONTINUATION_OWNER \+ c for c in leaving\]",
        "            pass",
        "a whole session's Release leaves its continuations' grants (unreachable by any selector after)",
    ),
    Mutant(
        "continuation-release-narrowed",
        "kvhint_server/executor.py",
        r"narrowed = sel\.has_range or sel\.kind is SelectorKind\.BLOCK_HASHES or bool\(spec\.max_blocks\)",
        "narrowed = sel.has_range or sel.kind is not SelectorKind.SESSION or bool(spec.max_blocks)",
        "a continuation's Release drops only grants on blocks it still resolves to (MISSING once it left the index)",
    ),
    Mutant(
        "unresumable-hint-accepted",
        "kvhint_server/executor.py",
        r"\(not clipped and \(kept or window_tails\.continues_beyond\(self\.core, hashes\)\)\)",
        "(not clipped)",
        "a hybrid Retain/Pin with no hit end to protect is ACCEPTED for blocks no resume hits",
    ),
    Mutant(
        "unresumable-ignores-chain-beyond",
        "kvhint_server/executor.py",
        r"\(not clipped and \(kept or window_tails\.continues_beyond\(self\.core, hashes\)\)\)",
        "(not clipped and bool(kept))",
        "a range inside a hybrid chain that goes on is granted nothing",
    ),
    Mutant(
        "page-token-any-tenant",
        "kvhint_server/servicer.py",
        r'tenant\.name\.encode\(\) if tenant is not None else b""',
        'b""',
        "a tenant's page token (ListSessions, QueryResidency) serves another tenant",
    ),
    Mutant(
        "snapshot-outside-share",
        "kvhint_server/watch.py",
        r"return submit\(\) if tenant is None or shares is None else shares\.submit\(tenant, submit\)",
        "return submit()",
        "a tenant's snapshot watches take engine-queue places outside its share",
    ),
    Mutant(
        "watch-refusal-uncounted",
        "kvhint_server/watch.py",
        r"            stats\.watch_streams \+= 1\n",
        "",
        "a WatchEvents call refused at the open-stream bound is not counted",
    ),
    Mutant(
        "vanished-file-kept",
        "engine_integration/tiers/feed.py",
        r"        if ext in self\.book\.on_disk:\n            self\._file_gone\(\[ext\]\)\n",
        "",
        "a file-tier copy deleted underneath KvHint stays reported on disk",
    ),
    Mutant(
        "failed-tier-start-kept",
        "engine_integration/tiers/operations.py",
        r"        except BaseException:\n            # The error reaches the executor(.*?)            self\._abandon\(op\)\n            raise",
        "        except BaseException:\n            raise",
        "a tier operation whose start raised keeps running",
    ),
    Mutant(
        "redeclared-template-kept",
        "kvhint_client/policy/policy.py",
        r"        if old is not None and old\.target != target:",
        "        if False:",
        "a template declared again with a new target keeps the old target's grant",
    ),
    Mutant(
        "ttl-capped-keep-deadline",
        "kvhint_client/policy/policy.py",
        r"            s\.ttl_until = min\(s\.ttl_until, intent\.sent_at \+ granted_s\)\n",
        "            pass\n",
        "a TTL_CAPPED keep is believed to last the TTL asked for",
    ),
    Mutant(
        "inline-error-uncounted",
        "kvhint_server/journal.py",
        r"            try:\n                fn\(\*args\)\n            except Exception:\n                self\.errors \+= 1\n                raise",
        "            fn(*args)",
        "an inline booking that raises is not counted",
    ),
    Mutant(
        "requested-ttl-float",
        "kvhint_server/wire.py",
        r"            clip\.requested_ttl\.FromNanoseconds\(c\.requested_ttl_ns\)",
        "            clip.requested_ttl.FromNanoseconds(int(round(c.requested_ttl_ns / 1e9 * 1e9)))",
        "Clip.requested_ttl goes through float seconds (1 ns off past 2**23 s)",
    ),
    # Session 52.
    Mutant(
        "forgotten-continuation-kept",
        "kvhint_server/executor.py",
        r"                leaving \+= self\._forgotten_continuations\(\{sel\.session_id, \*sessions\}\)\n",
        "",
        "a session's Release leaves the grants of a continuation the index's bounds forgot",
    ),
    Mutant(
        "forgotten-continuation-any-session",
        "kvhint_server/executor.py",
        r"and all\(s in named or s not in index\.sessions for s in linked\)",
        "and True",
        "a session's Release ends a forgotten continuation's grants that another live session listed",
    ),
    Mutant(
        "bench-takes-connection-flags",
        "kvhint_client/cli/bench_cmd.py",
        r'        "bench",\n',
        '        "bench", parents=[common],\n',
        "kvhint bench lists (and silently accepts) connection options it ignores",
    ),
    Mutant(
        "address-port-unchecked",
        "kvhint_client/config.py",
        r"    if not 1 <= port <= 65535:\n",
        "    if False:\n",
        "a client takes 127.0.0.1:99999 (gRPC wraps it to port 34463) and retries it for ever",
    ),
    Mutant(
        "breaker-forgets",
        "kvhint_client/fleet.py",
        r"                    self\._open\[engine\] = _Failing\(failures, now \+ self\._backoff\(failures\), probing, last\)",
        "                    pass",
        "FleetClient asks an engine that does not answer on every call (no failure memory)",
    ),
    Mutant(
        "breaker-skips-placed-engines",
        "kvhint_client/fleet.py",
        r"optional = \[e for e, asked_about in questions\.items\(\) if all\(found\[h\.hint_id\] for h in asked_about\)\]",
        "optional = list(questions)",
        "FleetClient's breaker skips an engine that may be a hint's only holder",
    ),
    Mutant(
        "follower-error-sticks",
        "kvhint_client/follow_tracker.py",
        r"            self\.status\.last_error = None\n",
        "            pass\n",
        "a live engine's status keeps the error of a stream that ended before",
    ),
    Mutant(
        "stale-engine-answers",
        "kvhint_client/residency_index.py",
        r"        if not include_stale and not self\._live\.get\(engine\):\n            return None\n",
        "",
        "ResidencyIndex.sessions(engine) answers for an engine that is not live",
    ),
    Mutant(
        "parent-watch-trusts-sentinel",
        "engine_integration/parent_watch.py",
        r"            if self\._ppid is None or os\.getppid\(\) != self\._ppid:\n                return True\n",
        "            return True\n",
        "a sentinel the living parent closed is taken for its end: EngineCore is stopped under a live API server",
    ),
    Mutant(
        "parent-watch-blind",
        "engine_integration/parent_watch.py",
        r"                gone = self\._gone\(\)\n",
        "                gone = self._stopped.wait(self._poll_s)\n",
        "an EngineCore whose API server was killed lives on, its sidecar SERVING",
    ),
    Mutant(
        "heartbeat-unbounded",
        "kvhint_server/config.py",
        r"    \"heartbeat_interval_s\": \(MIN_HEARTBEAT_S, MAX_HEARTBEAT_S, True\),\n",
        "",
        "KVHINT_HEARTBEAT_INTERVAL_S=1e-6 is accepted and floods every stream with heartbeats",
    ),
    Mutant(
        "overflow-blamed-on-window",
        "kvhint_server/watch.py",
        r"                if events is None and requested:\n",
        "                if events is None:\n",
        "a live subscriber the replay window passes gets COMPACTED instead of SUBSCRIBER_OVERFLOW",
    ),
    Mutant(
        "conformance-no-preflight",
        "conformance/runner.py",
        r"    unreachable = preflight\(options\)\n",
        "    unreachable = None\n",
        "a mistyped --target is every case failed with DEADLINE_EXCEEDED and exit 1",
    ),
    Mutant(
        "wait-ignores-failed-operation",
        "kvhint_client/cli/apply_cmd.py",
        r"\(r\.outcome == kvhint_pb2\.OUTCOME_DEFERRED and _succeeded\(operations\.get\(r\.operation_id\)\)\)",
        "r.outcome == kvhint_pb2.OUTCOME_DEFERRED",
        "kvhint apply --wait exits 0 for a DEFERRED hint whose operation FAILED or never finished",
    ),
    Mutant(
        "scenario-prompts-before-sidecar",
        "scripts/resume_scenario.py",
        r"    check_sidecar\(buf, grpc, token\)\n",
        "",
        "resume_scenario.py sends prompts before finding out the sidecar does not answer",
    ),
)


class AnchorMissing(RuntimeError):
    pass


def mutate(text: str, mutant: Mutant) -> str:
    pattern = re.compile(mutant.anchor, re.DOTALL if ".*?" in mutant.anchor else 0)
    matches = len(pattern.findall(text))
    if matches != 1:
        raise AnchorMissing(f"{mutant.name}: anchor {mutant.anchor!r} matches {matches} times in {mutant.path}")
    return pattern.sub(mutant.replacement, text, count=1)


def copy_tree(dest: Path) -> None:
    """The working tree as git sees it (tracked + untracked, not ignored)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, check=True, capture_output=True,
    ).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def run_suite(root: Path, paths: list[str], timeout: float) -> tuple[bool, str]:
    """True if the suite passed. Runs with `root` first on sys.path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    # The anchor check fails on any mutated tree (its anchor no longer matches), so it would
    # count as the kill of every mutant it runs before the tests that should catch it.
    cmd = [sys.executable, "-m", "pytest", "-m", "not engine", "-x", "-q", "-p", "no:cacheprovider",
           "--deselect", ANCHOR_TEST, *paths]
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, "timeout"
    last = [line for line in proc.stdout.splitlines() if line.strip()][-1:] or ["(no output)"]
    failed = [line for line in proc.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    if proc.returncode not in (0, 1, 2):  # 2: collection error (a mutant that breaks an import)
        raise RuntimeError(f"pytest exited {proc.returncode} ({last[0]}): no verdict\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return proc.returncode == 0, (failed[0] if failed else last[0])


def check_loaded_from(root: Path, mutant: Mutant) -> None:
    """The suite must import the copy, not the editable install in REPO."""
    module = mutant.path[: -len(".py")].replace("/", ".")
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(
        [sys.executable, "-c", f"import {module} as m; print(m.__file__)"],
        cwd=root, env=env, capture_output=True, text=True, check=True,
    ).stdout.strip()
    if Path(out).resolve() != (root / mutant.path).resolve():
        raise RuntimeError(f"{module} imports from {out}, not from {root}")


def report(rows: list[tuple[Mutant, str, float, str]], paths: list[str]) -> str:
    """The result as markdown: the command, then mutant -> result and the first failing test."""
    lines = [
        f"Written by `python3 tools/mutants.py --paths {' '.join(paths)}` on {time.strftime('%Y-%m-%d', time.gmtime())}.",
        "Each row: the mutant, and the first test that failed under it (`pytest -m \"not engine\" -x`).",
        "",
        "| mutant | file | what it breaks | result | first failing test |",
        "|---|---|---|---|---|",
    ]
    for m, result, _, detail in rows:
        test = detail.split(" ", 1)[1] if detail.startswith(("FAILED ", "ERROR ")) else ""
        lines.append(f"| {m.name} | {m.path} | {m.what} | {result} | {test.split(' - ')[0]} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paths", nargs="+", default=list(FAST_PATHS), help="test paths (default: the fast suite)")
    parser.add_argument("--only", nargs="+", help="mutant names")
    parser.add_argument("--in-place", action="store_true", help="mutate this checkout (restored afterwards)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per suite run")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--out", type=Path, help="also write the result table (markdown) to this file")
    args = parser.parse_args(argv)
    mutants = [m for m in MUTANTS if not args.only or m.name in args.only]
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:22} {m.path:34} {m.what}")
        return 0
    if args.only and len(mutants) != len(args.only):
        parser.error(f"unknown mutant in {args.only}")
    # Every anchor is checked before anything runs.
    for m in mutants:
        mutate((REPO / m.path).read_text(), m)

    tmp = None
    root = REPO
    if not args.in_place:
        tmp = tempfile.mkdtemp(prefix="kvhint-mutants-")
        root = Path(tmp)
        copy_tree(root)
    rows = []
    try:
        if tmp:
            check_loaded_from(root, mutants[0])
        ok, detail = run_suite(root, args.paths, args.timeout)
        if not ok:
            print(f"the unmutated suite fails ({detail}); fix that first", file=sys.stderr)
            return 2
        for m in mutants:
            target = root / m.path
            original = target.read_text()
            start = time.monotonic()
            try:
                target.write_text(mutate(original, m))
                passed, detail = run_suite(root, args.paths, args.timeout)
            finally:
                target.write_text(original)
            rows.append((m, "survived" if passed else "killed", time.monotonic() - start, detail))
            print(f"{m.name:22} {rows[-1][1]:8} {rows[-1][2]:6.1f}s  {detail}", flush=True)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    table = report(rows, args.paths)
    print("\n" + table)
    if args.out:
        args.out.write_text(table)
    survived = [m.name for m, result, _, _ in rows if result == "survived"]
    if survived:
        print(f"\nsurvived: {', '.join(survived)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except AnchorMissing as exc:
        print(f"anchor not found: {exc}", file=sys.stderr)
        sys.exit(2)
