"""Online pause-duration estimates, per tool name and session class.

A pause is the gap between a session's tool call starting and its next
request. `PauseModel.observe(key, seconds)` records one observed gap;
`PauseModel.residual(key, elapsed)` predicts how much longer a pause that has
lasted `elapsed` seconds will last.

Each key keeps a bounded sample of its most recent gaps (a sliding window,
`window` observations), so the estimate follows a drifting workload and
represents multi-modal shapes (a "short" tool that sometimes hangs) that one
log-normal would smear. Predictions back off through a hierarchy of keys
(tool + session class -> tool -> the declared duration class -> session
class -> everything: the keys `SessionPolicy` builds for a tool call) and blend the best key's sample with a log-normal prior
worth `prior_weight` observations: with no data the prior decides, with
many observations the data does.

Two predictions of a pause that has lasted `e` seconds:

* `residual`: the conditional q-quantile, the time until the q-quantile of
  the durations that exceed `e`. A session that has outlived most of its
  class's pauses is predicted to stay paused for longer.
* `reuse_index` (what `SessionPolicy` ranks by with `ranking="index"`;
  the default ranks by `residual`): a point quantile of a
  mixture (a tool that is usually quick and sometimes slow) ranks the
  session as if it were surely one or the other. The index instead prices
  the cache space a session's blocks hold per hit: for every horizon `h`,
  keeping the blocks until `h` (and giving up then) costs E[min(R, h)]
  seconds of space and hits with probability P(R <= h), R the remaining
  pause; the index is the smallest cost per hit over `h`,
  ``min_h E[min(R, h)] / P(R <= h)``, and the horizon is that `h`. For a
  known remaining time `r` the index is `r`; for "90% back in 1 s, else
  in a minute" it is about 1 s with horizon 1 s: keep it for a second,
  then, if it has not come back, re-predict (the short mode is gone, the
  index becomes about a minute). This is the Gittins index of the remaining
  pause; caches call its inverse hit density.

A pause can also end with no next request: the session ended while paused
(`PauseModel.observe_end`; an agent that answered with no tool call and whose
user left, a dead branch). Such a pause counts as one observation of
"never", so a key learns how often its pauses do not come back, and both
predictions are infinite when more than the quantile's share (`residual`) or
all the remaining mass (`reuse_index`, which prices the never-mass as space
held for no hit) would not: the caller should stop protecting the session
(SessionPolicy Releases it). An idle pause after an answer with no tool call
is the common case: in agent traffic it usually means the task is done.

The learned state (every key's recent gaps, oldest first) can be exported and
loaded (`PauseModel.export`, `PauseModel.load`): a router that restarts, or a
new replica, starts from what an earlier one learned instead of from the prior.
The state is plain JSON (`PAUSE_STATE_FORMAT`, version `PAUSE_STATE_VERSION`):

    {"format": "kvhint.pause_model", "version": 2,
     "keys": [{"key": ["declared", "long"], "samples": [31.5, 12.0, null, ...]}, ...]}

A null sample is a pause that ended its session (version 2; `load` also reads
version 1 exports, which have none).

Only the observations travel: the prior, `window`, `prior_weight`,
`min_samples` and `max_keys` are the loading model's own configuration.

The keys come from traffic (session class header values, tool names), so
their number is bounded: a model keeps at most `max_keys` keys (default
`DEFAULT_MAX_KEYS`, 4096), dropping the key observed least recently when a new
one would exceed it. An export lists the keys in that order (least recently
observed first); `load` keeps the last `max_keys` of them, so a loaded model
drops the same keys next as the model it came from.

Not thread-safe; owned by one `SessionPolicy`.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

_STD = NormalDist()

#: `PauseModel.export`'s "format" and "version" fields; `PauseModel.load` accepts exactly these.
PAUSE_STATE_FORMAT = "kvhint.pause_model"
PAUSE_STATE_VERSION = 2
#: Versions `PauseModel.load` reads (1: no null samples).
PAUSE_STATE_VERSIONS = (1, 2)
#: `PauseModel`'s default `max_keys`: how many keys it keeps (module doc).
DEFAULT_MAX_KEYS = 4096


@dataclass(frozen=True)
class LogNormalPrior:
    """A prior over pause durations: log-normal with median `median_s` and log-sd `sigma`."""

    median_s: float = 5.0
    sigma: float = 1.2

    def __post_init__(self) -> None:
        if not (self.median_s > 0 and self.sigma > 0 and math.isfinite(self.median_s) and math.isfinite(self.sigma)):
            raise ValueError(f"a log-normal prior needs median_s > 0 and sigma > 0, got {self.median_s}, {self.sigma}")

    def quantile(self, q: float) -> float:
        q = min(max(q, 1e-9), 1 - 1e-9)
        return self.median_s * math.exp(self.sigma * _STD.inv_cdf(q))

    def cdf(self, x: float) -> float:
        if x <= 0:
            return 0.0
        return _STD.cdf((math.log(x) - math.log(self.median_s)) / self.sigma)


class _Sample:
    """The last `window` observations of one key, also kept sorted."""

    __slots__ = ("recent", "ordered", "window")

    def __init__(self, window: int) -> None:
        self.recent: deque[float] = deque()
        self.ordered: list[float] = []
        self.window = window

    def add(self, x: float) -> None:
        self.recent.append(x)
        bisect.insort(self.ordered, x)
        if len(self.recent) > self.window:
            old = self.recent.popleft()
            del self.ordered[bisect.bisect_left(self.ordered, old)]

    def __len__(self) -> int:
        return len(self.ordered)


def _blend_quantile(sample: Sequence[float], prior: LogNormalPrior, weight: float, q: float) -> float:
    """The q-quantile of the mixture (sample, empirical) + (prior, `weight` pseudo-observations);
    infinite when more than 1 - q of the mass is the sample's never-observations (inf)."""
    n = len(sample)
    if n == 0:
        return prior.quantile(q)
    total = n + weight
    finite = bisect.bisect_left(sample, math.inf)
    if (finite + weight) / total < q:
        return math.inf
    top = sample[finite - 1] if finite else 0.0
    lo, hi = 0.0, max(top, prior.quantile(0.999)) * 2 + 1e-9
    for _ in range(1024):  # widen until the bracket holds the quantile (a q in the prior's far tail)
        if (bisect.bisect_right(sample, hi) + weight * prior.cdf(hi)) / total >= q or not math.isfinite(hi * 2):
            break
        lo, hi = hi, hi * 2
    for _ in range(64):  # bisection on the mixture CDF
        mid = (lo + hi) / 2
        mass = (bisect.bisect_right(sample, mid) + weight * prior.cdf(mid)) / total
        if mass < q:
            lo = mid
        else:
            hi = mid
    return hi


def _blend_cdf(sample: Sequence[float], prior: LogNormalPrior, weight: float, x: float) -> float:
    n = len(sample)
    return (bisect.bisect_right(sample, x) + weight * prior.cdf(x)) / (n + weight)


def _gittins(points: Sequence[tuple[float, float]], never: float = 0.0) -> tuple[float, float]:
    """min over h of E[min(R, h)] / P(R <= h) for R distributed as the weighted `points`
    (sorted by value) plus `never` weight at infinity, and the minimizing h. The ratio only needs
    checking at the points: between two of them E[min(R, h)] grows while P(R <= h) stays the
    same. With no finite points: (inf, inf)."""
    total = sum(w for _, w in points) + never
    best, horizon = math.inf, math.inf
    below = mass = 0.0  # sum of x*w and of w over the points <= h
    for x, w in points:
        below += x * w
        mass += w
        ratio = (below + x * (total - mass)) / mass
        if ratio < best:
            best, horizon = ratio, x
    return best, horizon


class PauseModel:
    """Per-key pause distributions learned online (see module doc).

    Keys are tuples from most to least specific, as `SessionPolicy` builds
    them, e.g. ``(("tool", "run_tests", "coder"), ("tool", "run_tests"),
    ("class", "coder"), ("declared", "long"), ("all",))``. `min_samples` is how
    many observations a key needs before it is preferred over a more general
    one. `prior_points`: the prior enters `reuse_index` as that many equally
    weighted quantile points. `max_keys`: the most keys kept; beyond it the
    key observed least recently is dropped (module doc).
    """

    def __init__(
        self,
        prior: LogNormalPrior | None = None,
        *,
        window: int = 256,
        prior_weight: float = 2.0,
        min_samples: int = 3,
        prior_points: int = 64,
        max_keys: int = DEFAULT_MAX_KEYS,
    ) -> None:
        if window < 1 or prior_weight <= 0 or min_samples < 1 or prior_points < 1:
            raise ValueError("window, min_samples and prior_points must be >= 1 and prior_weight > 0")
        if isinstance(max_keys, bool) or not isinstance(max_keys, int) or max_keys < 1:
            raise ValueError(f"max_keys must be an integer >= 1, got {max_keys!r}")
        self.max_keys = max_keys
        self.prior_points = prior_points
        self.prior = prior or LogNormalPrior()
        self.window = window
        self.prior_weight = prior_weight
        self.min_samples = min_samples
        self._samples: dict[tuple[str, ...], _Sample] = {}

    def observe(self, keys: Iterable[tuple[str, ...]], seconds: float) -> None:
        """Record one observed pause under every key of its hierarchy."""
        if not seconds >= 0 or math.isinf(seconds):
            return
        self._add(keys, seconds)

    def observe_end(self, keys: Iterable[tuple[str, ...]]) -> None:
        """Record a pause that ended its session (no next request) under every key."""
        self._add(keys, math.inf)

    def _add(self, keys: Iterable[tuple[str, ...]], seconds: float) -> None:
        samples = self._samples
        for key in keys:
            sample = samples.pop(key, None)
            if sample is None:
                sample = _Sample(self.window)
            samples[key] = sample  # most recently observed last
            sample.add(seconds)
            if len(samples) > self.max_keys:
                del samples[next(iter(samples))]  # the key observed least recently

    def export(self) -> dict[str, Any]:
        """The learned state as a JSON-serialisable dict (module doc): per key, least recently
        observed key first, its most recent observations (at most `window`), oldest first, None
        for a pause that ended its session. `load` of it into a model with the same
        configuration gives identical predictions, now and after further observations."""
        return {
            "format": PAUSE_STATE_FORMAT,
            "version": PAUSE_STATE_VERSION,
            "keys": [{"key": list(key), "samples": [None if math.isinf(x) else x for x in sample.recent]} for key, sample in self._samples.items()],
        }

    def load(self, state: Mapping[str, Any]) -> None:
        """Replace the learned state with `state` (what `export` returned, possibly from a
        model with another `window` or `max_keys`: a key with more samples keeps its most recent
        `window`, and of more than `max_keys` keys the last `max_keys`, the most recently observed).

        Raises ValueError, leaving the model unchanged, when `state` is not an export of a
        version in `PAUSE_STATE_VERSIONS`: another format or version, a key that is not a
        non-empty list of strings or appears twice, or a sample that is not a finite number >= 0
        (or, from version 2, null)."""
        parsed = _parse_state(state)
        samples: dict[tuple[str, ...], _Sample] = {}
        for key, values in parsed[-self.max_keys :]:
            sample = samples[key] = _Sample(self.window)
            for x in values[-self.window :]:
                sample.add(x)
        self._samples = samples

    def count(self, key: tuple[str, ...]) -> int:
        sample = self._samples.get(key)
        return len(sample) if sample else 0

    def _basis(self, keys: Sequence[tuple[str, ...]], prior: LogNormalPrior | None) -> tuple[list[float], LogNormalPrior]:
        """The most specific key with enough data, and the prior to blend it with."""
        for key in keys:
            sample = self._samples.get(key)
            if sample is not None and len(sample) >= self.min_samples:
                return sample.ordered, prior or self.prior
        return [], prior or self.prior

    def quantile(self, keys: Sequence[tuple[str, ...]], q: float, prior: LogNormalPrior | None = None) -> float:
        """The q-quantile of a pause's total duration."""
        sample, p = self._basis(keys, prior)
        return _blend_quantile(sample, p, self.prior_weight, q)

    def reuse_index(
        self, keys: Sequence[tuple[str, ...]], elapsed: float, prior: LogNormalPrior | None = None
    ) -> tuple[float, float]:
        """(index, horizon) of a pause that has lasted `elapsed` seconds (module doc): the
        smallest expected space-time per hit over the horizons a cache could keep it for, and
        that horizon (seconds from now; re-predict then if the pause goes on). Both >= 0."""
        sample, p = self._basis(keys, prior)
        e = max(elapsed, 0.0)
        k = self.prior_points
        finite = bisect.bisect_left(sample, math.inf)
        never = float(len(sample) - finite)
        points = [(x - e, 1.0) for x in sample[bisect.bisect_right(sample, e) : finite]]
        points += [(x - e, self.prior_weight / k) for x in (p.quantile((i + 0.5) / k) for i in range(k)) if x > e]
        if not points:
            if never:  # every pause this long ended its session
                return math.inf, math.inf
            # beyond everything seen and the prior's bulk: its conditional median
            r = self.residual(keys, e, prior, 0.5)
            return r, r
        return _gittins(sorted(points), never)

    def residual(self, keys: Sequence[tuple[str, ...]], elapsed: float, prior: LogNormalPrior | None = None, q: float = 0.5) -> float:
        """Seconds until the pause is expected to end, given it has lasted `elapsed` (the
        conditional q-quantile of the remaining time; >= 0; inf when more than 1 - q of the
        pauses that lasted this long ended their session)."""
        sample, p = self._basis(keys, prior)
        weight = self.prior_weight
        survived = _blend_cdf(sample, p, weight, max(elapsed, 0.0))
        target = survived + q * (1.0 - survived)
        end = _blend_quantile(sample, p, weight, min(target, 1 - 1e-9))
        if elapsed > 0 and end <= elapsed:
            # Past everything the model can place (the sample and the prior's far tail, where
            # the survival is below float resolution): no end in sight, as for a pause that
            # ends its session. A residual of 0 would say "due now" at every look, and a
            # caller re-sending its hint then never lets the session go.
            return math.inf
        return max(0.0, end - elapsed)


def _parse_state(state: Mapping[str, Any]) -> list[tuple[tuple[str, ...], list[float]]]:
    """`PauseModel.load`'s validation: the (key, samples) pairs of a well-formed state, or ValueError."""
    if not isinstance(state, Mapping):
        raise ValueError(f"pause state must be a mapping (PauseModel.export()), got {type(state).__name__}")
    if state.get("format") != PAUSE_STATE_FORMAT:
        raise ValueError(f"pause state format must be {PAUSE_STATE_FORMAT!r}, got {state.get('format')!r}")
    version = state.get("version")
    if type(version) is not int or version not in PAUSE_STATE_VERSIONS:
        raise ValueError(f"unsupported pause state version {version!r} (this model reads versions {PAUSE_STATE_VERSIONS})")
    entries = state.get("keys")
    if not isinstance(entries, list):
        raise ValueError(f"pause state 'keys' must be a list, got {type(entries).__name__}")
    out: list[tuple[tuple[str, ...], list[float]]] = []
    seen: set[tuple[str, ...]] = set()
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping) or set(entry) != {"key", "samples"}:
            raise ValueError(f"pause state keys[{i}] must be a mapping with exactly 'key' and 'samples'")
        raw_key, raw_samples = entry["key"], entry["samples"]
        if not isinstance(raw_key, (list, tuple)) or not raw_key or not all(isinstance(k, str) for k in raw_key):
            raise ValueError(f"pause state keys[{i}].key must be a non-empty list of strings, got {raw_key!r}")
        key = tuple(raw_key)
        if key in seen:
            raise ValueError(f"pause state key {list(key)!r} appears more than once")
        seen.add(key)
        if not isinstance(raw_samples, (list, tuple)) or not raw_samples:
            raise ValueError(f"pause state keys[{i}].samples must be a non-empty list of seconds")
        values: list[float] = []
        for x in raw_samples:
            if x is None and version >= 2:
                values.append(math.inf)  # a pause that ended its session
                continue
            try:  # (JSON integers have any number of digits: one past float's range overflows here)
                value = math.nan if isinstance(x, bool) or not isinstance(x, (int, float)) else float(x)
            except OverflowError:
                value = math.inf
            if not math.isfinite(value) or value < 0:
                raise ValueError(
                    f"pause state key {list(key)!r}: every sample must be a finite number >= 0"
                    f"{' or null' if version >= 2 else ''}, got {x!r}"
                )
            values.append(value)
        out.append((key, values))
    return out
