"""``tune``'s second phase: predict every candidate worth predicting, and rank them.

The simulation predicts a candidate in about a second, too slow for the thousands the settings multiply into, so the
search walks one setting at a time (coordinate ascent, the "quick" search of Triton's Model Analyzer, here on the
model): from the current config and export's default, try each value of one setting with the others held, keep the
best, go on, and repeat while a round improves. Every candidate predicted on the way is ranked for the report.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec

from service.tune.candidates import Candidate, Say, Space, preferred_sizes
from service.tune.measure import Measurements
from service.tune.model import Prediction, ServiceCurve, Simulator, Workload, predict


@dataclass
class Ranked:
    candidate: Candidate
    prediction: Prediction

    @property
    def rate(self) -> float:
        return self.prediction.rate


class Predictor:
    """Predictions of candidates from one set of measurements, cached."""

    def __init__(self, measured: Measurements, workload: Workload, target_p99_ms: float) -> None:
        self.workload = workload
        self.target = target_p99_ms
        self.curves: dict[tuple[str, str, int], ServiceCurve] = {}
        for figures in measured.runtimes:
            if figures.batch_ms:
                self.curves[figures.key] = ServiceCurve(figures, max(figures.batch_ms))
        self.cache: dict[Candidate, Prediction] = {}

    def with_workload(self, workload: Workload) -> Predictor:
        """A predictor of the same measurements under another workload (nothing cached)."""
        other = Predictor.__new__(Predictor)
        other.workload, other.target, other.curves, other.cache = workload, self.target, self.curves, {}
        return other

    def runtimes(self) -> list[tuple[str, str]]:
        return sorted({(b, p) for b, p, _t in self.curves})

    def curve_for(self, candidate: Candidate) -> ServiceCurve | None:
        return self.curves.get((candidate.backend, candidate.precision, candidate.threads))

    def normal(self, candidate: Candidate) -> Candidate:
        """``candidate`` with its batch sizes capped at the largest measured (larger ones miss the target alone)."""
        curve = self.curve_for(candidate)
        if curve is None or candidate.max_batch_size <= curve.largest:
            return candidate
        b = curve.largest
        preferred = tuple(p for p in candidate.preferred_batch_sizes if p <= b)
        return msgspec.structs.replace(candidate, max_batch_size=b, preferred_batch_sizes=preferred)

    def predict(self, candidate: Candidate) -> Prediction | None:
        """None when the candidate's runtime was not measured."""
        candidate = self.normal(candidate)
        curve = self.curve_for(candidate)
        if curve is not None and candidate not in self.cache:
            if oversubscribed(candidate, self.workload):
                self.cache[candidate] = Prediction(0.0, None, math.inf)
            else:
                self.cache[candidate] = predict(Simulator(candidate, curve, self.workload), self.target)
        return self.cache.get(candidate)


def oversubscribed(candidate: Candidate, workload: Workload) -> bool:
    """More intra-op threads than cores on the CPU: predicted to serve nothing at the target. The simulation shares
    the cores in proportion, but a parallel region waits at its barrier for its slowest thread, and with spinning
    threads that is far worse: two instances of two threads on two cores measured 10.8-12.1 requests/s at p99 <= 100
    ms against 19-25 for one (resnet18; docs/performance.md, "visionserve tune"), predicted 26-28."""
    return not workload.cuda and candidate.instances * (candidate.threads or workload.cores) > workload.cores


def _variations(c: Candidate, space: Space, runtimes: list[tuple[str, str]]) -> Iterable[list[Candidate]]:
    """For each setting, ``c`` with that setting at each of its values."""
    replace = msgspec.structs.replace
    kind = "half" if c.preferred_batch_sizes else "none"  # a new maximum keeps the preference, scaled to it
    yield [replace(c, backend=b, precision=p) for b, p in runtimes]
    yield [replace(c, threads=t) for t in space.threads]
    yield [replace(c, instances=n) for n in space.instances]
    yield [replace(c, max_batch_size=b, preferred_batch_sizes=preferred_sizes(kind, b)) for b in space.max_batch_size]
    yield [replace(c, max_queue_delay_ms=d) for d in space.max_queue_delay_ms]
    yield [replace(c, preferred_batch_sizes=preferred_sizes(k, c.max_batch_size)) for k in space.preferred]
    yield [replace(c, batch_policy=p) for p in space.batch_policy]
    yield [replace(c, workers=w) for w in space.workers]


def rank(
    predictor: Predictor,
    starts: list[Candidate],
    space: Space,
    *,
    seconds: float,
    say: Say,
    max_rounds: int = 3,
) -> list[Ranked]:
    """Every candidate predicted, best first (highest predicted rate; then lower predicted p50)."""
    started = time.perf_counter()
    runtimes = predictor.runtimes()

    def score(c: Candidate) -> tuple[float, float]:
        return _score(predictor.predict(c))

    for start in starts:
        best = predictor.normal(start)
        for round_ in range(max_rounds):
            before = best
            for options in _variations(best, space, runtimes):
                # Checked before each prediction, not each setting: a prediction takes about a second on a busy
                # 2-core machine, and a setting's 5-8 values overran a 3 s budget by 8 s there.
                for option in options:
                    if time.perf_counter() - started > seconds:
                        say(f"prediction budget ({seconds:.0f} s) spent after {len(predictor.cache)} candidates")
                        return _ranked(predictor)
                    score(option)
                best = max([predictor.normal(o) for o in options] + [best], key=score)
            say(f"round {round_ + 1} from {start.label}: best {best.label}, {score(best)[0]:.1f} req/s predicted")
            if best == before:
                break
    return _ranked(predictor)


def _score(p: Prediction | None) -> tuple[float, float]:
    """Higher is better: the predicted rate, then a lower p50 there (or p99 at the lowest rate, where none met)."""
    return (-1.0, 0.0) if p is None else (p.rate, -(p.at.p50_ms if p.at else p.floor_p99_ms))


def _ranked(predictor: Predictor) -> list[Ranked]:
    return sorted((Ranked(c, p) for c, p in predictor.cache.items()), key=lambda r: _score(r.prediction), reverse=True)


def structural(c: Candidate) -> tuple[object, ...]:
    """What makes two candidates really different (the queue delay and preferred sizes only fine-tune)."""
    return (c.backend, c.precision, c.max_batch_size, c.instances, c.threads, c.workers)


def shortlist(ranked: list[Ranked], count: int, exclude: Iterable[Candidate] = ()) -> list[Ranked]:
    """The best ``count``, one per structure: close variants of one configuration would spend the verification
    budget measuring the same thing within the noise."""
    seen = {structural(c) for c in exclude}
    chosen: list[Ranked] = []
    for r in ranked:
        if len(chosen) < count and r.rate > 0 and structural(r.candidate) not in seen:
            seen.add(structural(r.candidate))
            chosen.append(r)
    return chosen
