"""Many models under one load (README, "Load testing"): which models (patterns expanded from the server's repository
index), how popular each is (``uniform`` or ``zipf:S``: P(rank k) proportional to 1/k^S), the seeded draw that picks
each request's model, and what each model saw.

Each load process draws its requests' models in send order from a generator seeded by the run's ``--seed`` and the
process's index (never the stream its Poisson schedule draws from), so a run's draw can be replayed; every step
starts the same stream again, so steps of one run are driven alike. A response whose ``Server-Timing`` has a
``cold_start`` entry waited for its model's load (a miss); "answered" counts every HTTP answer, errors included (a
503 for a full budget is an answer without a cold start). Over gRPC no Server-Timing comes back, so cold starts are
not observed there.
"""

from __future__ import annotations

import bisect
import fnmatch
import itertools
import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from loadtest.histogram import LatencyHistogram
from service.core.percentile import percentile

NOT_ANSWERED = frozenset({"timeout", "connection", "unfinished", "client-overflow"})  # outcomes with no answer
PATTERN_CHARS = "*?["


@dataclass(frozen=True)
class ModelMix:
    """The models a load spreads over, in rank order, with each one's probability of being picked."""

    names: tuple[str, ...]
    weights: tuple[float, ...]  # sums to 1, one per name
    popularity: str = "uniform"  # as given: "uniform" or "zipf:S"

    @property
    def cumulative(self) -> tuple[float, ...]:
        return tuple(itertools.accumulate(self.weights))


def parse_popularity(text: str) -> tuple[str, float]:
    """``uniform`` -> ("uniform", 0.0); ``zipf:1.1`` -> ("zipf", 1.1); anything else is refused with what is allowed."""
    kind, _, param = text.strip().partition(":")
    if kind == "uniform" and not param:
        return "uniform", 0.0
    if kind == "zipf":
        try:
            s = float(param)
        except ValueError:
            s = math.nan
        if math.isfinite(s) and s >= 0:
            return "zipf", s
    raise ValueError(f"popularity must be 'uniform' or 'zipf:S' with a number S >= 0 (zipf:1.1), got {text!r}")


def make_mix(names: Sequence[str], popularity: str) -> ModelMix:
    """The mix of ``names`` (rank order) under ``popularity`` (see :func:`parse_popularity`)."""
    if not names:
        raise ValueError("a model mix needs at least one model")
    kind, s = parse_popularity(popularity)
    raw = [1.0 if kind == "uniform" else 1.0 / k**s for k in range(1, len(names) + 1)]
    total = sum(raw)
    return ModelMix(tuple(names), tuple(w / total for w in raw), popularity.strip())


def is_pattern(item: str) -> bool:
    return any(c in item for c in PATTERN_CHARS)


def split_models(text: str) -> list[str]:
    """``--models``' comma-separated items, blanks dropped."""
    return [item.strip() for item in text.split(",") if item.strip()]


def expand(items: Sequence[str], available: Sequence[str] | None) -> list[str]:
    """Names in the order given, each pattern replaced by the ``available`` names it matches (sorted); a name met
    twice is kept at its first place. Raises ValueError for a pattern that matches nothing (or with no index)."""
    out: list[str] = []
    for item in items:
        if not is_pattern(item):
            found = [item]
        elif available is None:
            raise ValueError(f"the pattern {item!r} needs the server's repository index")
        else:
            found = sorted(n for n in set(available) if fnmatch.fnmatchcase(n, item))
            if not found:
                raise ValueError(f"the pattern {item!r} matches no model of the repository index "
                                 f"({', '.join(sorted(set(available))) or 'empty'})")  # fmt: skip
        out += [n for n in found if n not in out]
    return out


def repository_names(url: str, admin_token: str | None, timeout_s: float = 30.0) -> list[str]:
    """Every model name the server's repository index lists (loaded or not). Raises ValueError with the reason when
    the index cannot be read (it is an admin route: the server needs ``--admin-token``, and so does this call)."""
    import httpx

    headers = {"authorization": f"Bearer {admin_token}"} if admin_token else {}
    try:
        r = httpx.post(url.rstrip("/") + "/v2/repository/index", headers=headers, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot read the repository index at {url}: {exc}") from exc
    if r.status_code != 200:
        hint = " (an admin route: pass the server's --admin-token)" if r.status_code in (401, 403) else ""
        raise ValueError(f"the repository index at {url} answered {r.status_code}{hint}: {r.text[:200]}")
    try:
        return [str(row["name"]) for row in r.json()]
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"the repository index at {url} is not a JSON list of {{'name': ...}}: {exc}") from exc


class ModelDraw:
    """Model indices in send order from a seeded generator: the same seed and weights give the same sequence."""

    def __init__(self, cumulative: Sequence[float], seed: str) -> None:
        self.cumulative = list(cumulative)
        self.rng = random.Random(seed)  # a str seed: its own stream, apart from the schedule's Random(int)

    def next(self) -> int:
        x = self.rng.random() * self.cumulative[-1]
        return min(bisect.bisect_right(self.cumulative, x), len(self.cumulative) - 1)


def draw_seed(seed: int, process: int) -> str:
    return f"models:{seed}:{process}"


def cold_start_ms(server_timing: str | None) -> float | None:
    """The ``cold_start`` entry's duration (ms) in a Server-Timing value; NaN for the entry without a ``dur``; None
    without the entry (the model was resident)."""
    if not server_timing:
        return None
    for entry in server_timing.split(","):
        name, *params = entry.split(";")
        if name.strip() != "cold_start":
            continue
        for param in params:
            key, _, value = param.partition("=")
            if key.strip().lower() == "dur":
                try:
                    return float(value.strip().strip('"'))
                except ValueError:
                    return math.nan
        return math.nan
    return None


@dataclass
class ModelTally:
    """What one model's measured requests saw, in one process or merged over several."""

    measured: int = 0  # requests sent (closed) or scheduled (open) inside the window
    requests: int = 0  # of those, answered 200
    answered: int = 0  # of those, answered at all (any status)
    errors: Counter[str] = field(default_factory=Counter)
    latency: LatencyHistogram = field(default_factory=LatencyHistogram)  # the 200s
    cold_starts: int = 0
    cold_start_ms: list[float] = field(default_factory=list)  # the durations the server gave

    def record(self, outcome: str, latency_s: float, server_timing: str | None) -> None:
        if outcome == "200":
            self.requests += 1
            self.latency.record(latency_s)
        else:
            self.errors[outcome] += 1
        if outcome not in NOT_ANSWERED:
            self.answered += 1
            cold = cold_start_ms(server_timing)
            if cold is not None:
                self.cold_starts += 1
                if math.isfinite(cold):
                    self.cold_start_ms.append(cold)

    def merge(self, other: ModelTally) -> None:
        for name in ("measured", "requests", "answered", "cold_starts", "cold_start_ms"):  # counts, and a list
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.errors.update(other.errors)
        self.latency.merge(other.latency)


def merged(tallies: Sequence[Sequence[ModelTally]], models: int) -> list[ModelTally]:
    """Per model, the sum of every part's tally."""
    out = [ModelTally() for _ in range(models)]
    for part in tallies:
        for total, t in zip(out, part, strict=True):
            total.merge(t)
    return out


def hit_rate(cold_starts: int, answered: int) -> float | None:
    return 1.0 - cold_starts / answered if answered else None


def summary(mix: ModelMix, tallies: Sequence[ModelTally], *, cold_observed: bool = True) -> dict[str, Any]:
    """The ``models`` object (keyed by name, in rank order) with the totals: ``cold_starts`` and ``hit_rate`` (None
    where cold starts cannot be observed, over gRPC, or nothing was answered)."""
    measured = sum(t.measured for t in tallies)
    models: dict[str, Any] = {}
    for name, weight, t in zip(mix.names, mix.weights, tallies, strict=True):
        models[name] = {
            "weight": weight, "share": t.measured / measured if measured else 0.0, "measured": t.measured,
            "requests": t.requests, "answered": t.answered, "errors": dict(sorted(t.errors.items())),
            "latency_ms": {"p50": 1000 * t.latency.quantile(0.5), "p99": 1000 * t.latency.quantile(0.99),
                           "max": 1000 * t.latency.max_s if t.latency.count else math.nan},
            "cold_starts": t.cold_starts if cold_observed else None,
            "cold_start_ms": {"p50": percentile(t.cold_start_ms, 0.5), "max": max(t.cold_start_ms)}
            if cold_observed and t.cold_start_ms else None,
            "hit_rate": hit_rate(t.cold_starts, t.answered) if cold_observed else None,
        }  # fmt: skip
    cold = sum(t.cold_starts for t in tallies)
    answered = sum(t.answered for t in tallies)
    return {
        "models": models,
        "cold_starts": cold if cold_observed else None,
        "answered": answered,
        "hit_rate": hit_rate(cold, answered) if cold_observed else None,
    }
