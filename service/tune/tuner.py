"""``visionserve tune`` from start to end (README, "Tuning"): measure (about a fifth of the budget), predict and rank
(a little), verify the best few, the current config and export's default for real (the rest, each a server start and
the steps of a search, scaled to fit), decide. Kept in a :class:`TuneRun` as it happens, so Ctrl-C leaves a report.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.core.config import ModelConfig
from service.core.repository import ModelEntry, ModelRepository
from service.core.samples import image_files, photo_like_jpegs
from service.supervisor import cpu_count, default_workers
from service.tune.candidates import Candidate, Say, Space, apply, candidate_from, export_default_config, space_for
from service.tune.measure import Measurements, measure
from service.tune.model import Workload
from service.tune.rank import Predictor, Ranked, rank, shortlist
from service.tune.verify import StepPlan, Verified, verify

if TYPE_CHECKING:
    from loadtest.pool import WorkerPool

MEASURE_SHARE = 0.2
PREDICT_SHARE = 0.08
RESERVE_S = 5.0  # the report and the config at the end
SERVER_OVERHEAD_S = 10.0  # a start and a stop, until the first one is measured (the default of --server-start-s)
# A step's p99 is one of its slowest few requests: at 25 requests/s a 5 s step's p99 is its second slowest of
# 125, and the same rate met and missed the target in turn (docs/performance.md, "visionserve tune"). Steps grow
# with the budget up to this.
MAX_STEP_S = 15.0
CALIBRATE_MIN_S = 4.0  # spare time the calibration and re-ranking need to be worth starting


@dataclass(frozen=True)
class TuneOptions:
    repository: str
    model: str
    slo_p99_ms: float
    budget_s: float = 600.0
    images: str | None = None
    image_size: tuple[int, int] = (500, 375)
    device: str = "auto"
    verify: int = 4  # best predicted candidates to verify (beside the current config and export's default)
    workers: int = 0  # the front ends the current deployment runs (0: serve's default)
    work: str = ""  # folder for the candidates' repositories and server logs
    server_start_s: float = SERVER_OVERHEAD_S  # a candidate server's start and stop, until the first is measured


@dataclass
class TuneRun:
    """What a run found, phase by phase (filled in as it goes)."""

    options: TuneOptions
    started: float = field(default_factory=time.perf_counter)
    measured: Measurements | None = None
    ranked: list[Ranked] = field(default_factory=list)
    current: Candidate | None = None
    default: Candidate | None = None
    verified: list[Verified] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # candidates not verified, and why
    phases_s: dict[str, float] = field(default_factory=dict)
    plan: StepPlan | None = None
    interrupted: bool = False
    base_config: ModelConfig | None = None
    calibration: dict[str, Any] | None = None  # the first verified candidate's fit of the server's CPU per request

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    @property
    def winner(self) -> Verified | None:
        """The verified candidate that served the most at the target (None: none met it)."""
        return max((v for v in self.verified if v.best_rate), key=lambda v: v.best_rate or 0.0, default=None)

    def find(self, candidate: Candidate | None) -> Verified | None:
        return next((v for v in self.verified if v.candidate == candidate), None)

    def best_seen(self) -> dict[str, Any] | None:
        """The lowest p99 of any step, and its rate: what to say when nothing met the target."""
        steps = [(s, v) for v in self.verified for s in v.steps if s["requests"] > 0]
        if not steps:
            return None
        step, v = min(steps, key=lambda sv: (sv[0]["p99_ms"], -sv[0]["rate"]))
        return {"p99_ms": step["p99_ms"], "rate": step["rate"], "errors": step["errors"], "label": v.candidate.label}


def _load_images(options: TuneOptions) -> tuple[list[bytes], str]:
    if options.images:
        return image_files(options.images), options.images
    w, h = options.image_size
    return photo_like_jpegs(32, (w, h)), f"32 generated {w}x{h} JPEGs"


def _plan_steps(remaining_s: float, count: int, overhead_s: float) -> tuple[StepPlan, int]:
    """Step shapes so that ``count`` verifications fit ``remaining_s`` (fewer candidates if even the shortest
    steps do not fit): (plan, how many fit)."""
    shortest = StepPlan(warmup_s=0.5, duration_s=1.0, max_steps=4, precision=0.1)
    for n in range(count, 0, -1):
        per = remaining_s / n - overhead_s
        for steps, precision in ((6, 0.05), (5, 0.08), (4, 0.1)):
            duration = per / steps - 1.0 - 0.6
            if duration >= 1.0:
                step_s = min(MAX_STEP_S, duration)
                return StepPlan(warmup_s=1.0, duration_s=step_s, max_steps=steps, precision=precision), n
        if per >= shortest.step_s * shortest.max_steps:
            return shortest, n
    # Even the shortest steps do not fit: the best predicted is verified with them all the same, since a tune answers
    # only what a real server showed (_verify_each says that the budget is overrun, and by how much).
    return shortest, min(count, 1)


@dataclass
class _Verifying:
    """The verification phase as it goes: the candidates left and the predictions they are held against, which the
    first measurement recalibrates."""

    todo: list[tuple[Candidate, float]]  # (candidate, predicted rate for the steps as they run)
    workload: Workload
    predictor: Predictor
    shaped: Predictor  # ``predictor`` for the plan's step shape
    space: Space
    plan: StepPlan
    starts: list[Candidate]  # the current config's and export's default: verified beside the best predicted


def tune(options: TuneOptions, run: TuneRun, say: Say) -> TuneRun:
    """Run every phase, filling ``run`` in place (so a KeyboardInterrupt leaves it usable: the caller catches it)."""
    entry = ModelRepository(options.repository).model(options.model)
    version = entry.latest
    run.base_config = entry.config
    images, label = _load_images(options)
    measured = _measure_phase(options, run, version.version, images, label, say)
    predictor, workload, space = _predict_phase(options, run, entry, measured, say)
    _verify_phase(options, run, entry, images, predictor, workload, space, say)
    return run


def _measure_phase(
    options: TuneOptions, run: TuneRun, version: int, images: list[bytes], label: str, say: Say
) -> Measurements:
    """1. The runtimes and the decoding, in-process, in about a fifth of the budget."""
    budget = options.budget_s
    t = time.perf_counter()
    say(f"measuring {options.model} v{version} in-process ({MEASURE_SHARE * budget:.0f} s of {budget:.0f} s)")
    run.measured = Measurements(options.model, version, "?", 0, 0.0, label)
    threads = space_for(cpu_count(), False, (), 1).threads
    measure(options.repository, options.model, images=images, slo_p99_ms=options.slo_p99_ms,
            seconds=MEASURE_SHARE * budget, threads=threads, device=options.device, say=say,
            out=run.measured)  # fmt: skip
    run.phases_s["measure"] = time.perf_counter() - t
    return run.measured


def _predict_phase(
    options: TuneOptions, run: TuneRun, entry: ModelEntry, measured: Measurements, say: Say
) -> tuple[Predictor, Workload, Space]:
    """2. Every candidate predicted from the measurements and ranked; the current config and export's default are
    placed beside them."""
    device = measured.device
    cuda = device.startswith("cuda")
    t = time.perf_counter()
    plan0 = StepPlan()
    workload = Workload(cores=measured.cores, decode_ms=measured.decode_ms, cuda=cuda, warmup_s=plan0.warmup_s,
                        duration_s=plan0.duration_s, max_queue_size=entry.config.max_queue_size)  # fmt: skip
    predictor = Predictor(measured, workload, options.slo_p99_ms)
    largest = max((max(f.batch_ms) for f in measured.runtimes if f.batch_ms), default=1)
    space = space_for(measured.cores, cuda, tuple(predictor.runtimes()), max(largest, entry.config.max_batch_size))
    default_config = export_default_config(entry.config.max_batch_size)
    run.current = candidate_from(entry.config, entry.latest, device, options.workers or default_workers())
    run.default = candidate_from(default_config, entry.latest, device, default_workers())
    say(f"predicting: {len(predictor.runtimes())} runtimes measured; searching the settings")
    run.ranked = rank(predictor, [run.current, run.default], space, seconds=PREDICT_SHARE * options.budget_s, say=say)
    run.phases_s["predict"] = time.perf_counter() - t
    return predictor, workload, space


def _verify_phase(
    options: TuneOptions,
    run: TuneRun,
    entry: ModelEntry,
    images: list[bytes],
    predictor: Predictor,
    workload: Workload,
    space: Space,
    say: Say,
) -> None:
    """3. The best predicted, the current config and export's default, each served for real and searched, as many
    as the budget fits."""
    from loadtest.inputs import payloads
    from loadtest.pool import WorkerPool

    t = time.perf_counter()
    starts = [c for c in (run.current, run.default) if c is not None]
    todo = _to_verify(options, run, predictor, starts)
    # Planned with slack: the re-prediction below and the calibration after the first candidate take time too,
    # and a plan that fits to the second would refuse its own last candidate.
    remaining = options.budget_s - run.elapsed() - RESERVE_S
    plan, fits = _plan_steps(0.9 * remaining - 2.0, len(todo), options.server_start_s)
    run.plan = plan
    run.skipped += [f"{c.label}: not verified, the budget fits {fits} of {len(todo)}" for c, _ in todo[fits:]]
    # Predicted again for the steps as they will run (the ranking assumed the default step): a short step lets a
    # rate just past capacity pass before its queue has grown, and the prediction should know it.
    shaped = _shaped(predictor, workload, plan)
    todo = [(c, _rate(shaped, c)) for c, _ in todo[:fits]]
    state = _Verifying(todo, workload, predictor, shaped, space, plan, starts)
    steps = f"{plan.max_steps} steps of {plan.duration_s:.1f} s at most"
    say(f"verifying {len(state.todo)} candidates on a real server ({steps})")
    with WorkerPool(1, payloads(options.model, images)) as pool:
        _verify_each(options, run, entry, state, pool, say)
    run.phases_s["verify"] = time.perf_counter() - t


def _to_verify(
    options: TuneOptions, run: TuneRun, predictor: Predictor, starts: list[Candidate]
) -> list[tuple[Candidate, float]]:
    """The best predicted, then the current config and export's default, then the next best up to
    ``options.verify``: (candidate, predicted rate)."""
    todo = [(r.candidate, r.rate) for r in shortlist(run.ranked, 1)]
    todo += [(c, _rate(predictor, c)) for c in dict.fromkeys(starts) if all(c != d for d, _ in todo)]
    todo += [(r.candidate, r.rate) for r in shortlist(run.ranked, options.verify - 1, exclude=[c for c, _ in todo])]
    return todo


def _shaped(predictor: Predictor, workload: Workload, plan: StepPlan) -> Predictor:
    return predictor.with_workload(replace(workload, warmup_s=plan.warmup_s, duration_s=plan.duration_s))


def _verify_each(
    options: TuneOptions, run: TuneRun, entry: ModelEntry, state: _Verifying, pool: WorkerPool, say: Say
) -> None:
    """Verify ``state.todo`` in order while the budget lasts; the first measurement recalibrates the rest."""
    budget, plan = options.budget_s, state.plan
    overhead = options.server_start_s
    folder = Path(options.work)
    i = 0
    while i < len(state.todo):
        c, predicted = state.todo[i]
        left = budget - run.elapsed() - RESERVE_S
        needed = overhead + plan.max_steps * plan.step_s
        if left < needed:
            # The plan was made before the load generator started and the predictions ran: on a slower machine
            # those took longer. Steps are shaped again to what is left; the first candidate is verified even
            # when nothing fits (the shortest steps), later ones only when their steps fit.
            fitted, fits = _plan_steps(left, 1, overhead)
            fitted_s = overhead + fitted.max_steps * fitted.step_s
            if run.verified and (not fits or fitted_s > left):
                run.skipped += [f"{d.label}: not verified, the budget ran out" for d, _ in state.todo[i:]]
                say(f"stopping verification: {budget - run.elapsed():.0f} s left, a candidate needs {needed:.0f} s")
                break
            if fitted_s > left:
                say(
                    f"the budget is spent ({max(0.0, left):.0f} s left): verifying {c.label} with the shortest "
                    f"steps all the same (about {fitted_s:.0f} s), since a tune answers only what a server showed"
                )
            plan = state.plan = run.plan = fitted
            state.shaped = _shaped(state.predictor, state.workload, plan)
        seen = [v.best_rate for v in run.verified if v.best_rate]  # predicted to meet nothing: below the best seen
        start = 0.7 * predicted if predicted > 0 else (max(seen) / 2 if seen else 5.0)
        say(f"verifying {i + 1}/{len(state.todo)}: {c.label} (predicted {predicted:.1f} req/s)")
        record = Verified(c, predicted)
        run.verified.append(record)
        verify(record, apply(entry.config, c), repository=Path(options.repository), model=options.model,
               folder=folder / f"candidate-{i + 1}", pool=pool, target_p99_ms=options.slo_p99_ms,
               start_rate=max(0.5, round(start, 1)), plan=plan, say=say)  # fmt: skip
        steps_s = sum(plan.step_s for _ in record.steps)
        overhead = max(options.server_start_s / 2, record.wall_s - steps_s)
        measured_text = f"{record.best_rate:.1f} req/s" if record.best_rate else "nothing met the target"
        say(f"  measured: {measured_text} ({record.wall_s:.0f} s; {run.elapsed():.0f} s of {budget:.0f} s used)")
        i += 1
        left = budget - run.elapsed() - RESERVE_S - needed * (len(state.todo) - 1)
        if i == 1 and record.best_rate and len(state.todo) > 1 and left > CALIBRATE_MIN_S:
            _recalibrate(options, run, state, record, left, say)


def _recalibrate(
    options: TuneOptions, run: TuneRun, state: _Verifying, record: Verified, left: float, say: Say
) -> None:
    """The first measurement calibrates the model: the server's own CPU per request (HTTP, transport, the loops'
    jitter) is what the in-process figures cannot see. Everything after is predicted again with it, so their
    prediction errors are out of sample."""
    c, predicted, workload = record.candidate, record.predicted_rate, state.workload
    assert record.best_rate is not None
    t_cal = time.perf_counter()
    frontend_ms = calibrate(state.shaped, c, record.best_rate, seconds=left / 2)
    run.calibration = {"candidate": c.label, "frontend_ms": frontend_ms, "frontend_ms_before": workload.frontend_ms,
                       "predicted_before": predicted, "measured": record.best_rate}  # fmt: skip
    record.calibrates = True
    say(f"calibrated: {frontend_ms:.2f} ms of server CPU per request (assumed {workload.frontend_ms:g})")
    state.workload = replace(workload, frontend_ms=frontend_ms)
    state.predictor = state.predictor.with_workload(state.workload)
    seconds = max(1.0, min(PREDICT_SHARE * options.budget_s / 2, left - (time.perf_counter() - t_cal)))
    run.ranked = rank(state.predictor, [*state.starts, c], state.space, seconds=seconds, say=say)
    state.shaped = _shaped(state.predictor, state.workload, state.plan)
    done = [v.candidate for v in run.verified]
    rest = [d for d in dict.fromkeys(state.starts) if d not in done]
    slots = len(state.todo) - 1
    rest += [r.candidate for r in shortlist(run.ranked, slots, exclude=done + rest)]
    state.todo = state.todo[:1] + [(d, _rate(state.shaped, d)) for d in rest[:slots]]
    run.phases_s["calibrate"] = time.perf_counter() - t_cal


def _rate(predictor: Predictor, c: Candidate) -> float:
    p = predictor.predict(c)
    return p.rate if p else 0.0


def calibrate(
    predictor: Predictor, c: Candidate, measured_rate: float, *, seconds: float = 30.0, tolerance: float = 0.03
) -> float:
    """The server CPU per request (``Workload.frontend_ms``) at which ``predictor`` predicts ``measured_rate``
    for ``c``, by bisection (the predicted rate falls as it grows); clamped to [0.05, 50] ms. Past ``seconds``
    the bracket's middle is taken as it stands."""
    low, high = 0.05, 50.0
    deadline = time.perf_counter() + seconds

    def rate_at(frontend_ms: float) -> float:
        return _rate(predictor.with_workload(replace(predictor.workload, frontend_ms=frontend_ms)), c)

    if rate_at(low) <= measured_rate:
        return low
    if rate_at(high) >= measured_rate:
        return high
    while high / low > 1 + tolerance and time.perf_counter() < deadline:
        mid = math.sqrt(low * high)
        if rate_at(mid) > measured_rate:
            low = mid
        else:
            high = mid
    return math.sqrt(low * high)
