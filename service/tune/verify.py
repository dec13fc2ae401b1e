"""``tune``'s proof: a candidate served for real (a repository of its own, the model's versions linked, a real
``visionserve serve`` started and stopped through :mod:`service.launcher`, however the search ends) and loaded with
the load tester's p99-target search.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.pool import WorkerPool
from loadtest.slo import search
from loadtest.step import StepBounds, StepResult, StepSpec, run_step
from service import launcher
from service.core.config import CONFIG_FILE, ModelConfig
from service.core.errors import VisionServeError
from service.tune.candidates import Candidate, Say, config_text

READY_TIMEOUT_S = 120.0
# A drill, not a setting: with this set to N, tune sends itself Ctrl-C (SIGINT to its process group, as a terminal
# does) as soon as it has reported its N-th verification step. A test that waited for the step's line and then sent
# the signal raced the end of the run: on a busy 2-core machine tune had finished before the signal came (exit 0
# instead of 130). docs/testing.md, "Drills".
DRILL_INTERRUPT_AFTER_STEP = "VISIONSERVE_DRILL_INTERRUPT_AFTER_STEP"


@dataclass(frozen=True)
class StepPlan:
    """How each step of a verification runs, and how many steps it may take."""

    warmup_s: float = 1.0
    duration_s: float = 4.0
    drain_s: float = 2.0
    max_steps: int = 6
    precision: float = 0.05  # the search stops when its bracket is this narrow (relative)
    timeout_s: float = 10.0  # per request

    @property
    def step_s(self) -> float:
        """About how long one step takes, start to end."""
        return self.warmup_s + self.duration_s + 0.6


@dataclass
class Verified:
    """What a candidate did on a real server."""

    candidate: Candidate
    predicted_rate: float
    steps: list[dict[str, Any]] = field(default_factory=list)  # rate, p50/p99 ms, errors, met, achieved req/s
    best_rate: float | None = None  # the highest rate that met the target (None: none did)
    best_p99_ms: float | None = None
    start_s: float = 0.0
    wall_s: float = 0.0
    error: str | None = None  # the server did not start, or the search failed
    interrupted: bool = False
    calibrates: bool = False  # its measurement calibrated the prediction of the candidates after it

    @property
    def prediction_error(self) -> float | None:
        """(predicted - measured) / measured, where both exist."""
        if not self.best_rate or not self.predicted_rate:
            return None
        return (self.predicted_rate - self.best_rate) / self.best_rate

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.candidate.label, "candidate": self.candidate.to_dict(),
                "predicted_rate": self.predicted_rate, "measured_rate": self.best_rate,
                "measured_p99_ms": self.best_p99_ms, "prediction_error": self.prediction_error,
                "steps": self.steps, "server_start_s": self.start_s, "wall_s": self.wall_s, "error": self.error,
                "interrupted": self.interrupted, "calibrates": self.calibrates}  # fmt: skip


def candidate_repository(repository: Path, model: str, config: ModelConfig, folder: Path) -> Path:
    """A repository in ``folder`` holding only ``model``, its versions linked, its config ``config``."""
    root = folder / "repo"
    target = root / model
    target.mkdir(parents=True, exist_ok=True)
    source = repository / model
    for version in source.iterdir():
        if version.is_dir() and version.name.isdigit() and not (target / version.name).exists():
            (target / version.name).symlink_to(version.resolve(), target_is_directory=True)
    (target / CONFIG_FILE).write_text(config_text(config))
    return root


def _step_record(step: StepResult, target_p99_ms: float) -> dict[str, Any]:
    met = step.error_count == 0 and step.requests > 0 and step.latency_ms(99) <= target_p99_ms
    return {"rate": step.spec.rate, "achieved_rps": step.requests_per_s, "requests": step.requests,
            "p50_ms": step.latency_ms(50), "p99_ms": step.latency_ms(99), "errors": step.error_count,
            "met": met, "client_limited": step.client_limited,
            "mean_batch": (step.server or {}).get("mean_batch_size"),
            "knee": ((step.server or {}).get("batch_costs") or {}).get("knee")}  # fmt: skip


def verify(
    result: Verified,
    config: ModelConfig,
    *,
    repository: Path,
    model: str,
    folder: Path,
    pool: WorkerPool,
    target_p99_ms: float,
    start_rate: float,
    plan: StepPlan,
    say: Say,
) -> Verified:
    """Serve ``result.candidate`` and search its highest rate meeting the target, filling ``result`` in place, so
    an interruption leaves in it the steps run so far."""
    started = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    repo = candidate_repository(repository, model, config, folder)
    try:
        log = folder / "server.log"
        with launcher.start(repo, log=log, workers=result.candidate.workers, ready_timeout_s=READY_TIMEOUT_S) as server:
            result.start_s = time.perf_counter() - started
            bounds = StepBounds(url=server.url, warmup_s=plan.warmup_s, duration_s=plan.duration_s,
                                drain_s=plan.drain_s, timeout_s=plan.timeout_s, max_requests=1_000_000)  # fmt: skip

            def step(rate: float) -> StepResult:
                outcome = run_step(pool, StepSpec("open", rate=rate), bounds, model)
                result.steps.append(_step_record(outcome, target_p99_ms))
                met = "meets" if result.steps[-1]["met"] else "misses"
                say(f"  {rate:8.1f} req/s: p99 {outcome.latency_ms(99):8.1f} ms, "
                    f"{outcome.error_count} errors: {met} the target")  # fmt: skip
                if os.environ.get(DRILL_INTERRUPT_AFTER_STEP) == str(len(result.steps)):
                    os.killpg(os.getpgrp(), signal.SIGINT)
                return outcome

            found = search(step, target_p99_ms, start_rate=start_rate, max_steps=plan.max_steps,
                           precision=plan.precision)  # fmt: skip
            if found.passed is not None:
                result.best_rate = found.passed.spec.rate
                result.best_p99_ms = found.passed.latency_ms(99)
    except KeyboardInterrupt:
        result.interrupted = True
        raise
    except (VisionServeError, OSError, RuntimeError) as exc:
        result.error = str(exc)
        say(f"  failed: {exc}")
    finally:
        result.wall_s = time.perf_counter() - started
    return result
