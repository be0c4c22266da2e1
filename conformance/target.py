"""The target under test: its gRPC surface, its OpenAI-compatible endpoint, what it advertises,
and the pressure plan derived from it.

Everything here is black-box: GetCapabilities, ApplyHints, QueryResidency, WatchEvents and
/v1/completions (token-id prompts, `X-Session-ID` header, `vllm_xargs.continuation_id`; for one
rank of a data-parallel engine, `X-data-parallel-rank` with the rank GetCapabilities names).

Capability vocabulary (`Case.requires`), derived from GetCapabilitiesResponse:

    <action>                 ActionSupport.supported (retain, pin, release, evict, demote, prefetch, share)
    <action>:<selector>      the action accepts that selector (session, continuation, block-hashes)
    <action>:range           ActionSupport.supports_range
    selector:<selector>      some supported action accepts that selector kind (the target resolves it)
    tier:<name>              a configured tier (device, host, disk, remote)
    share-destination        at least one Share destination is configured

Target requirements (`Case.needs`), checked by the `requirements/*` cases:

    traffic        --openai-url is given and /v1/completions accepts token-id prompts
    cached-tokens  responses report usage.prompt_tokens_details.cached_tokens for prefix hits
    pressure       the pool is small enough to be overflowed by at most --max-pressure-prompts
                   prompts, and no lower tier of unknown capacity can hold evicted blocks
"""

from __future__ import annotations

import math
import random
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import duration_pb2

from kvhint.v1 import kvhint_pb2 as pb
from kvhint.v1 import kvhint_pb2_grpc as pbg
from kvhint_client.errors import KvHintError
from kvhint_client.openai_traffic import Completion, CompletionError, complete, complete_batch, first_model

from . import hints as H
from . import profiles
from .model import Case, CaseFailed, CaseSkipped, check
from .watch import Collector


@dataclass(frozen=True)
class Options:
    target: str
    openai_url: str | None = None
    model: str | None = None
    # Longest prompt + completion the target's OpenAI endpoint accepts.
    max_model_len: int = 1024
    # Token ids used for synthetic prompts: [low, high). Must be ordinary tokens of the model.
    token_low: int = 3
    token_high: int = 4000
    # Upper bound on filler prompts one pressure round may take.
    max_pressure_prompts: int = 64
    # Upper bound on ApplyHints batches used to push events past the replay window.
    max_window_rpcs: int = 1000
    # Per-RPC deadline, seconds.
    rpc_timeout: float = 30.0
    # Per-request deadline for /v1/completions, seconds.
    http_timeout: float = 120.0
    # Greedy candidates whose logprobs are within this many nats are a numerical tie (see
    # conformance.cases.retention.first_divergence_is_a_tie): a few ulps of the engine's logits in
    # its compute dtype. The default, 2**-4, is 8 bfloat16 ulps of a logit in [1, 2): vLLM computes
    # a float32 checkpoint in bfloat16 on CPU, and the reference model's logits are that small.
    tie_nats: float = 2.0**-4
    # The conformance profile claimed (conformance.profiles): capabilities it requires fail
    # their cases when not advertised instead of skipping them.
    profile: str = profiles.DEFAULT
    # Bearer token for every RPC of the run (with tenants: an admin's token).
    token: str | None = None
    # Tenancy cases (conformance/cases/tenancy.py): two tenants' tokens and
    # session-id namespaces (prefixes). Those cases skip without them.
    tenant_a_token: str | None = None
    tenant_a_prefix: str | None = None
    tenant_b_token: str | None = None
    tenant_b_prefix: str | None = None
    nonce: str = field(default_factory=lambda: secrets.token_hex(4))


@dataclass(frozen=True)
class Plan:
    """Sizes derived from GetCapabilities and the options (see README "Requirements")."""

    block_size: int
    device_blocks: int
    # Device blocks plus the capacity of every bounded lower tier.
    capacity_blocks: int
    pin_budget: int
    # A "session prompt": session_blocks full blocks plus half a block.
    session_blocks: int
    session_tokens: int
    # Filler prompts (no session) that together overflow capacity_blocks plus a session.
    filler_tokens: int
    filler_count: int
    # The longest prompt used (concurrent-pressure cases), with room for 16 generated tokens.
    long_prompt_tokens: int
    pressure_ok: bool
    pressure_reason: str
    # n logical blocks -> (device blocks a cached n-block prompt keeps, device blocks its
    # prefill takes): see group_footprint. (n, n) on an engine with one KV-cache group.
    footprint: Callable[[int], tuple[int, int]] = field(default=lambda n: (n, n), compare=False, repr=False)
    # The fewest logical blocks a sliding-window group's cached tail spans (see window_tail_blocks);
    # 0 when no group has a sliding window.
    window_tail: int = 0
    # When every group that defines residency slides (a model with no full-attention layer), the
    # logical blocks of a prompt's window tail, which is all such an engine keeps of a prompt
    # (resident_tail_blocks); 0 when a prompt keeps every block (any full-attention residency).
    resident_tail: int = 0

    def resident_blocks(self, n: int) -> int:
        """Logical blocks reported resident (QueryResidency, pins, BlocksStored) after one prompt
        of `n` full blocks is cached: n, or its window tail on a sliding-window-only engine."""
        return min(n, self.resident_tail) if self.resident_tail else n

    @property
    def session_resident(self) -> int:
        """resident_blocks of a session prompt."""
        return self.resident_blocks(self.session_blocks)

    def cached_together(self, sessions: int) -> int:
        """Device blocks that `sessions` session prompts need to be cached at once, counting
        the last one's prefill (see group_footprint)."""
        if sessions <= 0:
            return 0
        cached, _ = self.footprint(self.session_blocks)
        return (sessions - 1) * cached + self.footprint(self.session_blocks + 1)[1]

    def overflow_filler(self, sessions: int) -> int:
        """Blocks of one filler prompt whose prefill, with `sessions` session prompts cached,
        needs every other free block plus about half of one session's blocks."""
        cached = self.footprint(self.session_blocks)[0]
        need = self.device_blocks - 1 - sessions * cached + math.ceil(cached / 2)
        blocks = 1
        while self.footprint(blocks)[1] < need and blocks < 1 << 20:
            blocks += 1
        return blocks

    def summary(self) -> str:
        return (
            f"block_size={self.block_size} device_blocks={self.device_blocks} capacity_blocks={self.capacity_blocks} "
            f"pin_budget={self.pin_budget} session_prompt={self.session_tokens} tokens ({self.session_blocks} blocks"
            + (f", {self.session_resident} of them resident: a window tail" if self.resident_tail else "")
            + f") pressure={self.filler_count}x{self.filler_tokens} tokens"
        )


def group_footprint(caps: pb.GetCapabilitiesResponse) -> Callable[[int], tuple[int, int]]:
    """n logical blocks -> (device blocks a cached prompt of n blocks keeps, device blocks its
    prefill takes), over the KV-cache groups GetCapabilities lists (one group when it lists
    none). Every group allocates the whole prompt during prefill; afterwards a sliding-window
    group keeps only the window tail, ceil((W - 1) / B) blocks of its own size B."""
    bs = max(1, caps.block_size)
    groups = list(caps.kv_cache_groups)

    def blocks(n: int, group_bs: int) -> int:
        return math.ceil(n * bs / max(1, group_bs or bs))

    def footprint(n: int) -> tuple[int, int]:
        if not groups:
            return n, n
        cached = prefill = 0
        for g in groups:
            own = blocks(n, g.block_size)
            prefill += own
            if g.kind == pb.KvCacheGroup.KIND_SLIDING_WINDOW and g.sliding_window_tokens:
                cached += min(own, math.ceil((g.sliding_window_tokens - 1) / max(1, g.block_size or bs)))
            else:
                cached += own
        return cached, prefill

    return footprint


def window_tail_blocks(caps: pb.GetCapabilitiesResponse) -> int:
    """The fewest logical blocks (of caps.block_size) that a sliding-window group's cached
    tail spans: ceil((W - 1) / B) blocks of the group's own size B, over every sliding-window
    group; 0 when there is none. A prefix hit that ends at block i needs that group's copies
    of the tail ending at i, and an engine may cache a prompt's window tail only where the
    prompt ended (vLLM does): then a prompt of at most this many blocks is the longest whose
    every shorter prefix is still hit-able once its tail is gone."""
    tails = [_tail_blocks(g, caps.block_size) for g in caps.kv_cache_groups if _slides(g)]
    return min(tails) if tails else 0


def _slides(group: pb.KvCacheGroup) -> bool:
    return group.kind == pb.KvCacheGroup.KIND_SLIDING_WINDOW and bool(group.sliding_window_tokens)


def _tail_blocks(group: pb.KvCacheGroup, block_size: int) -> int:
    """A sliding-window group's cached tail, ceil((W - 1) / B) blocks of its own size B, in
    logical blocks of `block_size`."""
    bs = max(1, block_size)
    own = max(1, group.block_size or bs)
    return math.ceil(math.ceil((group.sliding_window_tokens - 1) / own) * own / bs)


def resident_tail_blocks(caps: pb.GetCapabilitiesResponse) -> int:
    """0 when a cached prompt keeps every block resident; otherwise, when every group that defines
    residency is a sliding-window group (no full-attention layer), the logical blocks of the
    shortest such group's window tail, ceil((W - 1) / B) of its own blocks (KvCacheGroup: the
    engine keeps only the tails a resume reads, and a block is resident while every residency
    group holds it). Groups without the flag all define residency (the proto's default)."""
    groups = list(caps.kv_cache_groups)
    residency = [g for g in groups if g.defines_residency] or groups
    if not residency or not all(_slides(g) for g in residency):
        return 0
    return min(_tail_blocks(g, caps.block_size) for g in residency)


def every_page(method: str, fetch: Callable[[str], Any], field: str) -> list[Any]:
    """Every item of a paginated RPC: `fetch(page_token)` returns one response, whose
    repeated `field` holds the page's items; next_page_token is followed to the end.
    An RPC error or endless pagination fails the case."""
    items: list[Any] = []
    token = ""
    for _ in range(10_000):
        try:
            page = fetch(token)
        except grpc.RpcError as err:
            raise CaseFailed(f"{method} failed: {rpc_error_text(err)}") from err
        items.extend(getattr(page, field))
        token = page.next_page_token
        if not token:
            return items
    raise CaseFailed(f"{method} pagination did not end after 10000 pages")


def make_plan(caps: pb.GetCapabilitiesResponse, options: Options) -> Plan:
    bs = max(1, caps.block_size)
    device = int(caps.num_device_blocks)
    budget = caps.limits.pin_budget_blocks
    problems: list[str] = []
    lower = [t for t in caps.tiers if t.tier != pb.TIER_DEVICE]
    unbounded = [H.TIER_NAME.get(t.tier, str(t.tier)) for t in lower if not t.capacity_blocks]
    if unbounded:
        problems.append(
            f"lower tier(s) {', '.join(unbounded)} report no capacity, so no bounded load can push a session out of them"
        )
    capacity = device + sum(int(t.capacity_blocks) for t in lower)
    half = max(1, bs // 2)
    max_full = (options.max_model_len - 1 - half) // bs  # full blocks in a prompt that leaves room for 1 token
    # Three cached session prompts must fit the device pool together, also while the third is
    # being prefilled (on a hybrid model a prefill takes blocks in every KV-cache group), and one
    # session must fit the pin budget.
    footprint = group_footprint(caps)
    session_blocks = 1
    for n in range(min(max_full, budget if budget else max_full), 1, -1):
        cached = footprint(n)[0]
        prefill = footprint(n + 1)[1]  # a session or filler prompt: n blocks plus a partial one
        if 3 * cached + 4 <= device and 2 * cached + prefill + 2 <= device:
            session_blocks = n
            break
    if session_blocks < 2:
        problems.append(
            f"a session prompt would have {session_blocks} blocks (max_model_len={options.max_model_len}, "
            f"block_size={bs}, device blocks={device}, pin budget={budget}); at least 2 are needed"
        )
        session_blocks = 2
    session_tokens = session_blocks * bs + half
    filler_count = math.ceil((capacity + session_blocks) / session_blocks) + 1
    # A prompt that keeps only its window tail (a sliding-window-only engine) takes only that from
    # the pool once cached: overflowing the pool then takes more prompts. (The same count or fewer
    # on every other layout, whose prompts keep at least their logical blocks.)
    cached_each = footprint(session_blocks)[0]
    if 0 < cached_each < session_blocks:
        filler_count = max(filler_count, math.ceil((capacity + cached_each) / cached_each) + 1)
    if filler_count > options.max_pressure_prompts:
        problems.append(
            f"{filler_count} prompts of {session_tokens} tokens are needed to overflow {capacity} blocks; "
            f"--max-pressure-prompts is {options.max_pressure_prompts} (use a smaller pool or raise the bound)"
        )
    long_prompt = options.max_model_len - 24
    return Plan(
        block_size=bs,
        device_blocks=device,
        capacity_blocks=capacity,
        pin_budget=budget,
        session_blocks=session_blocks,
        session_tokens=session_tokens,
        filler_tokens=session_tokens,
        filler_count=filler_count,
        long_prompt_tokens=long_prompt,
        pressure_ok=not problems,
        pressure_reason="; ".join(problems),
        footprint=footprint,
        window_tail=window_tail_blocks(caps),
        resident_tail=resident_tail_blocks(caps),
    )


def advertised(caps: pb.GetCapabilitiesResponse) -> set[str]:
    out: set[str] = set()
    for support in caps.actions:
        name = H.ACTION_NAME.get(support.action)
        if name is None or not support.supported:
            continue
        out.add(name)
        for kind in support.selectors:
            if kind in H.SELECTOR_NAME:
                out.add(f"{name}:{H.SELECTOR_NAME[kind]}")
                out.add(f"selector:{H.SELECTOR_NAME[kind]}")
        if support.supports_range:
            out.add(f"{name}:range")
    for tier in caps.tiers:
        if tier.tier in H.TIER_NAME:
            out.add(f"tier:{H.TIER_NAME[tier.tier]}")
    if caps.share_destinations:
        out.add("share-destination")
    return out


class BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds `authorization: Bearer <token>` to every call."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, details: Any) -> Any:
        metadata = [*(details.metadata or ()), self._header]
        return details._replace(metadata=metadata) if hasattr(details, "_replace") else _Details(details, metadata)

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)


class _Details(grpc.ClientCallDetails):
    def __init__(self, base: Any, metadata: list[tuple[str, str]]) -> None:
        self.method, self.timeout, self.credentials = base.method, base.timeout, base.credentials
        self.wait_for_ready, self.compression = base.wait_for_ready, base.compression
        self.metadata = metadata


class Target:
    """One engine under test. Shared by all cases of a run."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.channel = grpc.insecure_channel(options.target)
        if options.token:
            self.channel = grpc.intercept_channel(self.channel, BearerToken(options.token))
        self.stub = pbg.KvHintServiceStub(self.channel)
        self._caps: pb.GetCapabilitiesResponse | None = None
        self._caps_error: str | None = None
        self._needs: dict[str, tuple[bool, str]] = {}
        self._model: str | None = options.model
        self._model_checked = options.model is not None
        self.full_hit_tokens: int | None = None  # cached tokens of an immediate session-prompt repeat
        self._lock = threading.Lock()

    # -- capabilities ---------------------------------------------------------------------

    @property
    def caps(self) -> pb.GetCapabilitiesResponse:
        if self._caps is None and self._caps_error is None:
            try:
                self._caps = self.stub.GetCapabilities(pb.GetCapabilitiesRequest(), timeout=self.options.rpc_timeout, wait_for_ready=True)
            except grpc.RpcError as err:
                self._caps_error = f"GetCapabilities failed: {err.code().name}: {err.details()}"
        if self._caps is None:
            raise CaseFailed(self._caps_error or "GetCapabilities failed")
        return self._caps

    def refresh_caps(self) -> pb.GetCapabilitiesResponse:
        self._caps = None
        self._caps_error = None
        return self.caps

    @property
    def capabilities(self) -> set[str]:
        return advertised(self.caps)

    @property
    def plan(self) -> Plan:
        return make_plan(self.caps, self.options)

    def missing_capabilities(self, case: Case) -> list[str]:
        have = self.capabilities
        return [c for c in case.requires if c not in have]

    def profile_gaps(self, capabilities: Iterable[str]) -> list[str]:
        """Those of `capabilities` that the selected profile requires (not advertised = failure)."""
        needed = profiles.required(self.options.profile)
        return [c for c in capabilities if c in needed]

    # -- requirements ---------------------------------------------------------------------

    def need(self, name: str) -> tuple[bool, str]:
        """(met, reason) for a target requirement; probes run once per run."""
        with self._lock:
            if name not in self._needs:
                self._needs[name] = self._probe(name)
            return self._needs[name]

    def _probe(self, name: str) -> tuple[bool, str]:
        try:
            if name == "traffic":
                return self._probe_traffic()
            if name == "cached-tokens":
                ok, reason = self.need_unlocked("traffic")
                if not ok:
                    return ok, reason
                return self._probe_cached_tokens()
            if name == "pressure":
                plan = self.plan
                if not plan.pressure_ok:
                    return False, plan.pressure_reason
                return self.need_unlocked("cached-tokens")
        except CaseFailed as exc:
            return False, str(exc)
        raise ValueError(f"unknown requirement {name!r}")

    def need_unlocked(self, name: str) -> tuple[bool, str]:
        if name not in self._needs:
            self._needs[name] = self._probe(name)
        return self._needs[name]

    def _probe_traffic(self) -> tuple[bool, str]:
        if not self.options.openai_url:
            return False, "no --openai-url given"
        prompt = self.token_ids("probe-traffic", 3 * max(1, self.caps.block_size) + 1)
        try:
            out = self.complete(prompt, session_id=f"kvc-{self.options.nonce}-probe")
        except Exception as exc:  # noqa: BLE001
            return False, f"/v1/completions with a token-id prompt and X-Session-ID failed: {exc}"
        if out.prompt_tokens != len(prompt):
            return False, f"usage.prompt_tokens={out.prompt_tokens} for a {len(prompt)}-token prompt given as token ids"
        return True, ""

    def _probe_cached_tokens(self) -> tuple[bool, str]:
        plan = self.plan
        prompt = self.token_ids("probe-cached", plan.session_tokens)
        session = f"kvc-{self.options.nonce}-probe"
        first = self.complete(prompt, session_id=session)
        second = self.complete(prompt, session_id=session)
        expected = plan.session_blocks * plan.block_size
        if second.cached_tokens < expected:
            return False, (
                f"a repeated {len(prompt)}-token prompt reported cached_tokens={second.cached_tokens} "
                f"(first: {first.cached_tokens}); expected at least {expected} (its {plan.session_blocks} full blocks). "
                "The endpoint must report usage.prompt_tokens_details.cached_tokens (vLLM: --enable-prompt-tokens-details) "
                "and keep prefix caching on"
            )
        self.full_hit_tokens = second.cached_tokens
        return True, ""

    # -- traffic --------------------------------------------------------------------------

    def token_ids(self, seed: str, n: int) -> list[int]:
        rng = random.Random(f"{self.options.nonce}/{seed}")
        return [rng.randrange(self.options.token_low, self.options.token_high) for _ in range(n)]

    def model(self) -> str | None:
        if not self._model_checked:
            self._model_checked = True
            try:
                self._model = first_model(self.options.openai_url or "")
            except Exception:  # noqa: BLE001 - the endpoint may serve without /v1/models
                self._model = None
        return self._model

    def complete(self, prompt: list[int], *, session_id: str | None = None, continuation_id: str | None = None,
                 parent_session_id: str | None = None, max_tokens: int = 1,
                 extra_body: dict[str, object] | None = None) -> Completion:
        if not self.options.openai_url:
            raise CaseSkipped("no --openai-url given")
        try:
            return complete(
                self.options.openai_url, prompt, model=self.model(), session_id=session_id,
                continuation_id=continuation_id, parent_session_id=parent_session_id, max_tokens=max_tokens,
                timeout=self.options.http_timeout, extra_body=extra_body, extra_headers=self._rank_header(),
            )
        except CompletionError as exc:
            raise CaseFailed(f"/v1/completions failed: HTTP {exc.status}: {exc.body[:200]}") from exc
        except OSError as exc:
            raise CaseFailed(f"/v1/completions failed: {exc}") from exc

    def complete_batch(self, prompts: list[list[int]], *, max_tokens: int = 1) -> list[str]:
        """Several prompts in one /v1/completions request, so the engine gets them together."""
        if not self.options.openai_url:
            raise CaseSkipped("no --openai-url given")
        try:
            return complete_batch(
                self.options.openai_url, prompts, model=self.model(), max_tokens=max_tokens,
                timeout=self.options.http_timeout, extra_headers=self._rank_header(),
            )
        except CompletionError as exc:
            raise CaseFailed(f"/v1/completions with {len(prompts)} prompts failed: HTTP {exc.status}: {exc.body[:200]}") from exc
        except OSError as exc:
            raise CaseFailed(f"/v1/completions with {len(prompts)} prompts failed: {exc}") from exc

    def _rank_header(self) -> dict[str, str] | None:
        """A data-parallel target is one rank of its engine: send its traffic to that rank
        (vLLM's X-data-parallel-rank header), so the sessions land where the target sees them."""
        caps = self.caps
        if caps.data_parallel_size > 1:
            return {"X-data-parallel-rank": str(caps.data_parallel_rank)}
        return None

    def close(self) -> None:
        self.channel.close()


def check_result_form(result: pb.HintResult, what: str) -> None:
    """Fail the case when `result` breaks the form every HintResult keeps (hints.result_form_problems:
    affected_blocks one entry per tier, in Tier order, each > 0; no reason on ACCEPTED or DEFERRED).
    The cases whose subject is a result's outcome (outcomes/*, clipping/*, evict/skips-blocks-in-use)
    check it on the results they examine; the others leave it to them, so one malformed field does
    not fail every case that applies a hint."""
    problems = H.result_form_problems(result)
    check(not problems, f"{what}: {H.describe(result)}: {'; '.join(problems)}")


def rpc_error_text(err: grpc.RpcError) -> str:
    e = KvHintError.from_rpc_error(err)
    return str(e)


class CaseContext:
    """What a case sees: the target plus per-case names, cleanup and helpers."""

    def __init__(self, target: Target, case: Case, index: int) -> None:
        self.target = target
        self.case = case
        self._prefix = f"kvc-{target.options.nonce}-{index:03d}"
        self._release: list[pb.Selector] = []
        self._collectors: list[Collector] = []
        self.notes: list[str] = []

    # -- naming ---------------------------------------------------------------------------

    def sid(self, name: str) -> str:
        """A session id unique to this run and case."""
        return f"{self._prefix}-{name}"

    def cid(self, name: str) -> str:
        """A continuation id unique to this run and case."""
        return f"{self._prefix}-{name}/c"

    def tokens(self, name: str, n: int) -> list[int]:
        return self.target.token_ids(f"{self.case.id}/{name}", n)

    def note(self, text: str) -> None:
        self.notes.append(text)

    # -- shortcuts ------------------------------------------------------------------------

    @property
    def caps(self) -> pb.GetCapabilitiesResponse:
        return self.target.caps

    @property
    def plan(self) -> Plan:
        return self.target.plan

    @property
    def stub(self) -> pbg.KvHintServiceStub:
        return self.target.stub

    @property
    def timeout(self) -> float:
        return self.target.options.rpc_timeout

    def complete(self, prompt: list[int], session: str | None = None, **kw: Any) -> Completion:
        return self.target.complete(prompt, session_id=session, **kw)

    def complete_batch(self, prompts: list[list[int]], **kw: Any) -> list[str]:
        return self.target.complete_batch(prompts, **kw)

    def session_prompt(self, name: str) -> list[int]:
        return self.tokens(name, self.plan.session_tokens)

    def small_prompt(self, name: str, blocks: int = 3) -> list[int]:
        bs = self.plan.block_size
        return self.tokens(name, blocks * bs + max(1, bs // 2))

    @property
    def lower_tiers(self) -> bool:
        """The target has tiers below the device pool: an evicted device block may still be hit
        from there, so "not hit after Evict" is only checked without them."""
        return any(t.tier != pb.TIER_DEVICE for t in self.caps.tiers)

    @property
    def full_hit(self) -> int:
        if self.target.full_hit_tokens is None:
            ok, reason = self.target.need("cached-tokens")
            if not ok:
                raise CaseSkipped(reason)
        assert self.target.full_hit_tokens is not None
        return self.target.full_hit_tokens

    # -- RPCs -----------------------------------------------------------------------------

    def apply_response(self, *hints: pb.Hint) -> pb.ApplyHintsResponse:
        for h in hints:
            self._remember_release(h)
        try:
            response: pb.ApplyHintsResponse = self.stub.ApplyHints(pb.ApplyHintsRequest(hints=list(hints)), timeout=self.timeout)
        except grpc.RpcError as err:
            raise CaseFailed(f"ApplyHints failed: {rpc_error_text(err)}") from err
        check(
            len(response.results) == len(hints),
            f"ApplyHints returned {len(response.results)} results for {len(hints)} hints",
        )
        return response

    def apply(self, *hints: pb.Hint) -> list[pb.HintResult]:
        return list(self.apply_response(*hints).results)

    def apply_one(self, hint: pb.Hint) -> pb.HintResult:
        (result,) = self.apply(hint)
        return result

    def _remember_release(self, h: pb.Hint) -> None:
        if h.WhichOneof("action") in ("pin", "retain") and h.HasField("selector"):
            sel = pb.Selector()
            sel.CopyFrom(h.selector)
            sel.ClearField("range")
            if sel not in self._release:
                self._release.append(sel)

    def residency(self, selector: pb.Selector, tiers: Iterable[int] = (), page_size: int = 0) -> list[pb.BlockInfo]:
        """Every QueryResidency page, in order."""
        tiers = list(tiers)
        return every_page(
            "QueryResidency",
            lambda token: self.stub.QueryResidency(
                pb.QueryResidencyRequest(selector=selector, tiers=tiers, page_size=page_size, page_token=token),  # type: ignore[arg-type]
                timeout=self.timeout,
            ),
            "blocks",
        )

    def device_hashes(self, selector: pb.Selector) -> list[bytes]:
        return [b.block_hash for b in self.residency(selector) if pb.TIER_DEVICE in b.tiers]

    def latest_sequence(self, after: int | None = None) -> int:
        """The current event sequence, read through a no-op ApplyHints (a Release of an unknown
        session, answered MISSING, which publishes one HintApplied event: the proto's HintApplied,
        every hint an ApplyHints call answers is published, whatever its outcome).

        With `after` (an earlier reading in this epoch), the case fails unless the sequence moved
        past it, saying that the target published no HintApplied for the probe it answered; a
        case that needs the probe's event (one that comes after something it watched) passes it."""
        probe = H.release(f"kvc-{self.target.options.nonce}-seqprobe-{time.monotonic_ns()}")
        try:
            response = self.stub.ApplyHints(pb.ApplyHintsRequest(hints=[probe]), timeout=self.timeout)
        except grpc.RpcError as err:
            raise CaseFailed(f"ApplyHints failed: {rpc_error_text(err)}") from err
        if after is not None:
            answer = H.describe(response.results[0]) if response.results else "no result"
            check(
                response.applied_at_sequence > after,
                f"the target published no HintApplied for a hint it answered ({answer}, a Release of an unknown "
                f"session): applied_at_sequence stayed at {response.applied_at_sequence} (was {after}). The proto's "
                "HintApplied: every hint an ApplyHints call answers is published as one HintApplied event, whatever "
                "its outcome (REJECTED and MISSING included)",
            )
        return response.applied_at_sequence

    def watch(self, request: pb.WatchEventsRequest | None = None, **kw: Any) -> Collector:
        req = request if request is not None else pb.WatchEventsRequest(**kw)
        collector = Collector(self.target.channel, req)
        self._collectors.append(collector)
        return collector

    def watch_now(self, **kw: Any) -> Collector:
        """A START_NOW subscription (heartbeats every 200 ms) that is known to be registered: it
        waits for the first message, which the server only sends once the subscription exists."""
        req = pb.WatchEventsRequest(start=pb.WatchEventsRequest.START_NOW, heartbeat_interval=duration_pb2.Duration(nanos=200_000_000), **kw)
        collector = self.watch(req)
        collector.wait_for(lambda ms: len(ms) > 0, 15, "the first message (a heartbeat) of a new subscription")
        return collector

    # -- load -----------------------------------------------------------------------------

    def pressure(self, tag: str, count: int | None = None, tokens: int | None = None) -> None:
        """Filler prompts without a session: enough to overflow the pool (see Plan)."""
        plan = self.plan
        for i in range(plan.filler_count if count is None else count):
            self.complete(self.tokens(f"filler-{tag}-{i}", tokens or plan.filler_tokens))

    # -- cleanup --------------------------------------------------------------------------

    def cleanup(self) -> None:
        for collector in self._collectors:
            collector.stop()
        if self._release:
            hints = [pb.Hint(selector=s, release=pb.ReleaseAction()) for s in self._release]
            limit = max(1, self.caps.limits.max_hints_per_batch or 1)
            for i in range(0, len(hints), limit):
                try:
                    self.stub.ApplyHints(pb.ApplyHintsRequest(hints=hints[i : i + limit]), timeout=self.timeout)
                except grpc.RpcError:
                    pass


def poll(fn: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if fn():
            return True
        time.sleep(interval)
    return fn()
