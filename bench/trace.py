"""Agentic trace format for the KvHint benchmark (JSON lines, versioned).

A trace is what an agent runtime would record while driving an engine: the
requests it sent, in time order, and the runtime signals it knew at each
moment. The offline simulators (`bench.simulate`) and the reference hint
policy (`bench.policy`) both read it; a real-engine replay expands the same
prompts to token ids.

File layout
-----------
Line 1 is the header, one JSON object::

    {"format": "kvhint-trace", "version": 1,
     "block_size": 32, "vocab_size": 4096, "min_token_id": 3,
     "num_gpu_blocks": 331,          # engine pool size INCLUDING vLLM's null block
     "max_model_len": 4096,
     "seed": 0, "preset": "default", "params": {...},   # generator inputs (informational)
     "duration_classes": {"short": 2.0, "long": 40.0},  # runtime's nominal upper bound (s) per class
     "shared_prefix": {"segment": "shared", "tokens": 512, "continuation_id": "..."} | null,
     "stats": {...}}                 # informational (peak live set, token counts)

Every further line is one event; events are sorted by ``t`` (seconds, nominal
trace clock starting at 0). ``kind`` selects the shape:

``request`` -- one generate call::

    {"kind": "request", "t": 3.25, "request_id": "r0007", "session_id": "s03",
     "parent_session_id": null, "continuation_id": "9f2c...", "turn": 2,
     "prompt": [{"seg": "shared", "len": 512}, {"seg": "u/s03/0", "len": 143},
                {"out": "r0002", "len": 32}, {"seg": "tool/s03/0", "len": 210}, ...],
     "max_tokens": 32,
     "after": "r0002", "delay_s": 1.4, "cause": "short", "t_done": 3.91}

  ``prompt`` is a list of segment references that expand deterministically:

  * ``{"seg": NAME, "len": N}``: N pseudo-random token ids seeded by NAME
    (blake2b of the name -> numpy PCG64), ids in ``[min_token_id, vocab_size)``.
    The same name always expands to the same ids, so shared content (the
    system/tool prefix, a parent's context inside a child's prompt) is shared
    token-for-token and therefore block-for-block.
  * ``{"out": REQUEST_ID, "len": N}``: the N output tokens that request
    REQUEST_ID generated (an earlier request; N == its ``max_tokens``). Offline
    they expand to a deterministic placeholder (as if NAME were ``out/<id>``);
    a real-engine replay passes the tokens the engine actually produced
    (``Trace.expand_prompt(req, outputs=...)``), which requires ``ignore_eos``
    so every request produces exactly ``max_tokens`` tokens. Either way the
    next turn's prompt contains the previous turn's output verbatim, which is
    what makes vLLM's decode-block caching matter.
  * ``{"tokens": [ids...]}``: literal token ids (for user-recorded traces).

  ``after``/``delay_s``/``cause`` are ground truth for closed-loop replay:
  the request is issued ``delay_s`` after request ``after`` completed (tool
  duration, child wait, ...). ``cause`` is ``"start"`` (first turn),
  ``"short"``/``"long"`` (the TRUE duration class of the tool call),
  ``"spawn"`` (a child session's first turn, ``after`` = the parent's request) or
  ``"children"`` (parent resuming after its sub-agents). ``t`` is the arrival
  time and ``t_done`` the completion time under the generator's nominal
  single-server service model (or as recorded; optional). The simulators run
  requests sequentially and apply a signal before a request when the signal
  is no later than the request's start, ``max(t, t_done of earlier requests)``
  -- a sequential engine starts a queued request only when the previous one
  completes, and the completion is when the runtime learns of tool calls. The
  policy never sees these fields.

Runtime signals (what an agent runtime knows, and all the policy may use)::

    {"kind": "tool_call_started", "t": 4.1, "session_id": "s03",
     "expected_duration_class": "short" | "long", "tool_call_id": "s03/2",
     "tool": "run_tests"}           # optional: the tool's name
    {"kind": "session_ended", "t": 9.0, "session_id": "s03"}
    {"kind": "child_spawned", "t": 5.0, "parent_session_id": "s03",
     "child_session_id": "s03.c1"}

  ``expected_duration_class`` is the runtime's guess; it can be wrong (the
  generator flips it with a configurable probability). The true duration is
  only visible through the next request's ``delay_s``/``cause``. It is optional
  (a runtime that knows only the tool's name omits it, or writes null):
  kvhint_client.policy then learns from the tool name alone, and the earlier
  reference policy treats the pause as long. ``tool`` and ``tool_call_id`` are
  optional too.

Required fields: the header's ``format``, ``version`` and ``block_size``; every
event's ``kind`` and ``t``; a request's ``request_id``, ``session_id``,
``prompt`` and ``max_tokens``; a signal's session ids. A line that breaks the
format is reported by its line number (`TraceError`).

Ordering of equal timestamps: requests before signals, then file order.
Token ids are ``< vocab_size`` (4096 for the project's tiny models) and
``>= min_token_id`` (ids 0-2 are special) for ``seg`` segments.

Block identity offline: `chain_hashes` hashes full blocks of ``block_size``
tokens, each hash chained over its parent (blake2b-64 over parent hash and the
block's token ids, little-endian uint16). Identical prefixes give identical
block ids, exactly the property vLLM's prefix cache relies on; the values are
not vLLM's hashes (an engine replay maps them through its own hasher).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Union

import numpy as np

FORMAT = "kvhint-trace"
VERSION = 1
DURATION_CLASSES = ("short", "long")


class TraceError(ValueError):
    """A trace that breaks the format; the message names the line (and file, when loaded from one)."""


# --------------------------------------------------------------------------- segments


@dataclass(frozen=True)
class Seg:
    """Named pseudo-random segment: ``len`` ids seeded by ``name``."""

    name: str
    length: int

    def to_json(self) -> dict[str, Any]:
        return {"seg": self.name, "len": self.length}


@dataclass(frozen=True)
class Out:
    """The ``length`` output tokens of an earlier request ``request_id``."""

    request_id: str
    length: int

    def to_json(self) -> dict[str, Any]:
        return {"out": self.request_id, "len": self.length}


@dataclass(frozen=True)
class Tok:
    """Literal token ids."""

    ids: tuple[int, ...]

    @property
    def length(self) -> int:
        return len(self.ids)

    def to_json(self) -> dict[str, Any]:
        return {"tokens": list(self.ids)}


SegmentRef = Union[Seg, Out, Tok]


def segment_from_json(obj: Mapping[str, Any]) -> SegmentRef:
    if not isinstance(obj, Mapping):
        raise ValueError(f"a prompt segment must be an object ({{\"seg\"|\"out\"|\"tokens\": ...}}), got {obj!r}")
    if "seg" in obj:
        return Seg(str(obj["seg"]), int(obj["len"]))
    if "out" in obj:
        return Out(str(obj["out"]), int(obj["len"]))
    if "tokens" in obj:
        return Tok(tuple(int(x) for x in obj["tokens"]))
    raise ValueError(f"unknown segment reference: {obj!r}")


def _seed_of(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


@lru_cache(maxsize=8192)
def _segment_tokens_cached(name: str, length: int, vocab_size: int, min_token_id: int) -> np.ndarray:
    rng = np.random.default_rng(_seed_of(name))
    arr = rng.integers(min_token_id, vocab_size, size=length, dtype=np.int64)
    arr.setflags(write=False)
    return arr


def segment_tokens(name: str, length: int, vocab_size: int = 4096, min_token_id: int = 3) -> np.ndarray:
    """Deterministic token ids of a named segment (read-only int64 array)."""
    if length < 0:
        raise ValueError("negative segment length")
    return _segment_tokens_cached(name, length, vocab_size, min_token_id)


def output_placeholder_name(request_id: str) -> str:
    return f"out/{request_id}"


# --------------------------------------------------------------------------- hashing

ROOT_HASH = 0


def chain_hashes(tokens: Sequence[int] | np.ndarray, block_size: int, parent: int = ROOT_HASH) -> list[int]:
    """Content-chained 64-bit ids of the FULL blocks of ``tokens``.

    ``h[i] = blake2b64(h[i-1] || uint16le(tokens[i*bs:(i+1)*bs]))`` with
    ``h[-1] = parent``. A trailing partial block gets no id (vLLM hashes only
    full blocks).
    """
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= 65536):
        raise ValueError("token ids must fit in uint16")
    raw = arr.astype("<u2").tobytes()
    nfull = arr.size // block_size
    step = 2 * block_size
    out: list[int] = []
    h = parent
    for i in range(nfull):
        d = hashlib.blake2b(h.to_bytes(8, "little"), digest_size=8)
        d.update(raw[i * step : (i + 1) * step])
        h = int.from_bytes(d.digest(), "little")
        out.append(h)
    return out


# --------------------------------------------------------------------------- events


@dataclass(frozen=True)
class Request:
    t: float
    request_id: str
    session_id: str
    parent_session_id: str | None
    continuation_id: str
    turn: int
    prompt: tuple[SegmentRef, ...]
    max_tokens: int
    after: str | None = None
    delay_s: float | None = None
    cause: str | None = None
    t_done: float | None = None

    kind = "request"

    @property
    def num_prompt_tokens(self) -> int:
        return sum(s.length for s in self.prompt)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "t": self.t,
            "request_id": self.request_id,
            "session_id": self.session_id,
            "parent_session_id": self.parent_session_id,
            "continuation_id": self.continuation_id,
            "turn": self.turn,
            "prompt": [s.to_json() for s in self.prompt],
            "max_tokens": self.max_tokens,
            "after": self.after,
            "delay_s": self.delay_s,
            "cause": self.cause,
            "t_done": self.t_done,
        }


@dataclass(frozen=True)
class ToolCallStarted:
    t: float
    session_id: str
    expected_duration_class: str | None = None  # the runtime's guess (optional; written only when set)
    tool_call_id: str = ""
    tool: str | None = None  # the tool's name (optional; written only when set)

    kind = "tool_call_started"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "t": self.t, "session_id": self.session_id}
        if self.expected_duration_class is not None:
            out["expected_duration_class"] = self.expected_duration_class
        out["tool_call_id"] = self.tool_call_id
        if self.tool is not None:
            out["tool"] = self.tool
        return out


@dataclass(frozen=True)
class SessionEnded:
    t: float
    session_id: str

    kind = "session_ended"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "t": self.t, "session_id": self.session_id}


@dataclass(frozen=True)
class ChildSpawned:
    t: float
    parent_session_id: str
    child_session_id: str

    kind = "child_spawned"

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "t": self.t,
            "parent_session_id": self.parent_session_id,
            "child_session_id": self.child_session_id,
        }


Signal = Union[ToolCallStarted, SessionEnded, ChildSpawned]
Event = Union[Request, ToolCallStarted, SessionEnded, ChildSpawned]
SIGNAL_KINDS = ("tool_call_started", "session_ended", "child_spawned")


def event_from_json(obj: Mapping[str, Any]) -> Event:
    if not isinstance(obj, Mapping):
        raise ValueError(f"an event must be a JSON object, got {type(obj).__name__}")
    kind = obj.get("kind")
    t = float(obj["t"])
    if kind == "request":
        return Request(
            t=t,
            request_id=str(obj["request_id"]),
            session_id=str(obj["session_id"]),
            parent_session_id=obj.get("parent_session_id"),
            continuation_id=str(obj.get("continuation_id") or obj["request_id"]),
            turn=int(obj.get("turn", 0)),
            prompt=tuple(segment_from_json(s) for s in obj["prompt"]),
            max_tokens=int(obj["max_tokens"]),
            after=obj.get("after"),
            delay_s=None if obj.get("delay_s") is None else float(obj["delay_s"]),
            cause=obj.get("cause"),
            t_done=None if obj.get("t_done") is None else float(obj["t_done"]),
        )
    if kind == "tool_call_started":
        raw_cls = obj.get("expected_duration_class")
        cls = None if raw_cls is None else str(raw_cls)
        if cls is not None and cls not in DURATION_CLASSES:
            raise ValueError(
                f"expected_duration_class {cls!r} is not one of {list(DURATION_CLASSES)} (omit it if the runtime has no guess)"
            )
        tool = obj.get("tool")
        return ToolCallStarted(
            t, str(obj["session_id"]), cls, str(obj.get("tool_call_id", "")), None if tool is None else str(tool)
        )
    if kind == "session_ended":
        return SessionEnded(t, str(obj["session_id"]))
    if kind == "child_spawned":
        return ChildSpawned(t, str(obj["parent_session_id"]), str(obj["child_session_id"]))
    raise ValueError(f"unknown event kind {kind!r} (one of: request, {', '.join(SIGNAL_KINDS)})")


def _sort_key(indexed: tuple[int, Event]) -> tuple[float, int, int]:
    i, e = indexed
    return (e.t, 0 if isinstance(e, Request) else 1, i)


def sort_events(events: Iterable[Event]) -> list[Event]:
    """Stable time order; requests before signals at equal ``t``."""
    return [e for _, e in sorted(enumerate(events), key=_sort_key)]


# --------------------------------------------------------------------------- trace


@dataclass
class TraceHeader:
    block_size: int = 32
    vocab_size: int = 4096
    min_token_id: int = 3
    num_gpu_blocks: int = 0
    max_model_len: int = 4096
    seed: int | None = None
    preset: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    duration_classes: dict[str, float] = field(default_factory=lambda: {"short": 2.0, "long": 40.0})
    shared_prefix: dict[str, Any] | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    version: int = VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": self.version,
            "block_size": self.block_size,
            "vocab_size": self.vocab_size,
            "min_token_id": self.min_token_id,
            "num_gpu_blocks": self.num_gpu_blocks,
            "max_model_len": self.max_model_len,
            "seed": self.seed,
            "preset": self.preset,
            "params": self.params,
            "duration_classes": self.duration_classes,
            "shared_prefix": self.shared_prefix,
            "stats": self.stats,
        }

    def pool_blocks(self, override: int | None = None) -> int:
        """The engine pool a replay or simulation uses: `override` (`--num-gpu-blocks`) or the
        header's `num_gpu_blocks` (vLLM's null block included); TraceError when it is below 2."""
        n = override or self.num_gpu_blocks
        if n < 2:
            raise TraceError(f"--num-gpu-blocks {override}: at least 2" if override else
                             "the header has no num_gpu_blocks (the engine's pool, vLLM's null block included); "
                             "pass --num-gpu-blocks N")
        return n

    def describe(self) -> str:
        """How reports name the trace: "default trace, seed 0" for a generated one."""
        if self.preset is None:
            return "recorded trace" if self.seed is None else f"trace seed {self.seed}"
        return f"{self.preset} trace" + ("" if self.seed is None else f", seed {self.seed}")

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> TraceHeader:
        if obj.get("format") != FORMAT:
            raise ValueError(
                f'line 1 must be the header, {{"format": "{FORMAT}", "version": {VERSION}, "block_size": ...}}; '
                f"its format is {obj.get('format')!r}"
            )
        version = int(obj.get("version", 0))
        if version != VERSION:
            raise ValueError(f"unsupported trace version {version} (this reader: {VERSION})")
        block_size = int(obj["block_size"])
        if block_size < 1:
            raise ValueError(f"block_size {block_size}: at least 1")
        return cls(
            block_size=block_size,
            vocab_size=int(obj.get("vocab_size", 4096)),
            min_token_id=int(obj.get("min_token_id", 3)),
            num_gpu_blocks=int(obj.get("num_gpu_blocks", 0)),
            max_model_len=int(obj.get("max_model_len", 4096)),
            seed=obj.get("seed"),
            preset=obj.get("preset"),
            params=dict(obj.get("params") or {}),
            duration_classes={k: float(v) for k, v in (obj.get("duration_classes") or {}).items()},
            shared_prefix=obj.get("shared_prefix"),
            stats=dict(obj.get("stats") or {}),
            version=version,
        )


@dataclass
class Trace:
    header: TraceHeader
    events: list[Event]

    # ---- views
    def requests(self) -> list[Request]:
        return [e for e in self.events if isinstance(e, Request)]

    def signals(self) -> list[Signal]:
        return [e for e in self.events if not isinstance(e, Request)]

    def request_index(self) -> dict[str, Request]:
        return {r.request_id: r for r in self.requests()}

    # ---- token expansion
    def segment_ids(self, ref: SegmentRef, outputs: Mapping[str, Sequence[int]] | None = None) -> np.ndarray:
        h = self.header
        if isinstance(ref, Seg):
            return segment_tokens(ref.name, ref.length, h.vocab_size, h.min_token_id)
        if isinstance(ref, Out):
            if outputs is not None and ref.request_id in outputs:
                ids = np.asarray(outputs[ref.request_id], dtype=np.int64)
                if ids.size != ref.length:
                    raise ValueError(
                        f"output of {ref.request_id} has {ids.size} tokens, trace expects {ref.length}"
                        " (replay with ignore_eos so max_tokens is exact)"
                    )
                return ids
            return segment_tokens(output_placeholder_name(ref.request_id), ref.length, h.vocab_size, h.min_token_id)
        return np.asarray(ref.ids, dtype=np.int64)

    def expand_prompt(self, req: Request, outputs: Mapping[str, Sequence[int]] | None = None) -> list[int]:
        """Prompt token ids of ``req``. ``outputs`` maps request ids to the
        tokens an engine actually generated (else deterministic placeholders)."""
        return self.expand_prompt_array(req, outputs).tolist()

    def expand_prompt_array(self, req: Request, outputs: Mapping[str, Sequence[int]] | None = None) -> np.ndarray:
        parts = [self.segment_ids(s, outputs) for s in req.prompt]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def output_placeholder(self, req: Request) -> np.ndarray:
        return segment_tokens(
            output_placeholder_name(req.request_id), req.max_tokens, self.header.vocab_size, self.header.min_token_id
        )

    def shared_prefix_tokens(self) -> list[int]:
        """Token ids of the shared system/tool prefix (for a prefix Retain)."""
        sp = self.header.shared_prefix
        if not sp:
            return []
        return segment_tokens(sp["segment"], int(sp["tokens"]), self.header.vocab_size, self.header.min_token_id).tolist()

    # ---- validation
    def validate(self) -> None:
        """Structural checks: time order, unique ids, outputs refer to earlier
        requests with matching lengths, segment names have one length, token
        ranges, prompt + max_tokens within max_model_len."""
        seen_req: dict[str, Request] = {}
        seg_len: dict[str, int] = {}
        last_t = float("-inf")
        last_rank = 0
        h = self.header
        for e in self.events:
            rank = 0 if isinstance(e, Request) else 1
            if (e.t, rank) < (last_t, last_rank):
                raise TraceError(
                    f"events out of order: {_describe(e)} at t={e.t} after t={last_t} (sort by t; requests before signals at equal t)"
                )
            last_t, last_rank = e.t, rank
            if not isinstance(e, Request):
                continue
            if e.request_id in seen_req:
                raise TraceError(f"duplicate request id {e.request_id}")
            for s in e.prompt:
                if isinstance(s, Seg):
                    if seg_len.setdefault(s.name, s.length) != s.length:
                        raise TraceError(f"segment {s.name} used with two lengths")
                elif isinstance(s, Out):
                    src = seen_req.get(s.request_id)
                    if src is None:
                        raise TraceError(f"{e.request_id} uses output of unknown/later request {s.request_id}")
                    if src.max_tokens != s.length:
                        raise TraceError(f"{e.request_id}: output length mismatch for {s.request_id}")
                else:
                    if any(not (0 <= x < h.vocab_size) for x in s.ids):
                        raise TraceError(f"{e.request_id}: literal token out of vocab")
            if e.num_prompt_tokens < 1 or e.max_tokens < 1:
                raise TraceError(f"{e.request_id}: empty prompt or max_tokens < 1")
            if e.num_prompt_tokens + e.max_tokens > h.max_model_len:
                raise TraceError(f"{e.request_id}: prompt+max_tokens exceeds max_model_len")
            seen_req[e.request_id] = e

    # ---- (de)serialisation
    def iter_lines(self) -> Iterator[str]:
        yield json.dumps(self.header.to_json(), separators=(",", ":"), sort_keys=True)
        for e in self.events:
            yield json.dumps(e.to_json(), separators=(",", ":"))

    def dumps(self) -> str:
        return "\n".join(self.iter_lines()) + "\n"

    @classmethod
    def loads(cls, text: str) -> Trace:
        return cls.from_lines(text.splitlines())

    @classmethod
    def from_lines(cls, lines: Iterable[str]) -> Trace:
        """Parse a trace; a line that breaks the format raises `TraceError` naming the line
        (1-based, blank lines counted)."""
        numbered = ((n, ln) for n, ln in enumerate(lines, 1) if ln.strip())
        first = next(numbered, None)
        if first is None:
            raise TraceError("empty trace (line 1 must be the header)")
        header = _parse_line(first, lambda obj: TraceHeader.from_json(_object(obj)), "header")
        events = [_parse_line(item, event_from_json, "event") for item in numbered]
        return cls(header, events)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.dumps())

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        with open(path) as f:
            try:
                return cls.from_lines(f)
            except TraceError as e:
                raise TraceError(f"{path}: {e}") from e.__cause__


def _describe(e: Event) -> str:
    return f"request {e.request_id}" if isinstance(e, Request) else f"{e.kind} of {getattr(e, 'session_id', None) or getattr(e, 'parent_session_id', '')}"


def _object(obj: Any) -> Mapping[str, Any]:
    if not isinstance(obj, Mapping):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    return obj


def _parse_line(item: tuple[int, str], parse: Any, what: str) -> Any:
    n, line = item
    try:
        return parse(json.loads(line))
    except json.JSONDecodeError as e:
        raise TraceError(f"line {n}: not JSON ({e.msg} at column {e.colno})") from e
    except KeyError as e:
        raise TraceError(f"line {n}: {what} has no {e.args[0]!r} field") from e
    except (TypeError, ValueError) as e:
        raise TraceError(f"line {n}: bad {what}: {e}") from e
