"""Rollouts: a candidate version beside the serving one, compared on live requests, promoted or aborted on the
evidence (docs/rollouts.md). Only requests naming no version take part (a :class:`Submit` whose ``route`` is not
None), and the engine, not the front end, chooses their version: a front end that has not yet heard of a promotion
still lands its requests on the version that serves, and nothing is sent to a version being unloaded. Comparison
work is queued at the lowest priority and shed, never queued, while live work waits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from service.core.comparison import verdict
from service.core.config import RolloutConfig
from service.core.errors import (
    BadInputError,
    DeadlineExceededError,
    NotFoundError,
    OverloadedError,
    VisionServeError,
)
from service.core.repository import ModelEntry, ModelRepository
from service.core.tasks import task_for
from service.engine.batcher import InferRequest, InferResult
from service.engine.model import ModelEngine
from service.engine.ondemand import Residency
from service.engine.residency import Charge
from service.engine.rollout_record import STATE_FILE, Rollout, read_state, rollout_config, write_state
from service.engine.table import ModelTable
from service.transport.messages import RolloutQuery, Submit, VersionKey

log = logging.getLogger("visionserve.rollout")

SHADOW_PRIORITY = 1 << 30  # after every live request of any priority


@dataclasses.dataclass(eq=False)
class Rollouts:
    """Every model's rollout on one engine, and the version that serves requests naming none. Handed the model
    ``table``, the memory accounts (``residency``), the ``repository`` (a candidate not loaded yet is read from it)
    and the loader of one version (``make_engine``)."""

    table: ModelTable
    residency: Residency
    repository: ModelRepository
    make_engine: Callable[[ModelEntry, int], Awaitable[ModelEngine]]
    _: dataclasses.KW_ONLY
    drain_timeout_s: float = 30.0
    by_model: dict[str, Rollout] = dataclasses.field(default_factory=dict, init=False)
    # model -> the version requests without one get (where not the highest)
    serving: dict[str, int] = dataclasses.field(default_factory=dict, init=False)
    _tasks: set[asyncio.Task[Any]] = dataclasses.field(default_factory=set, init=False, repr=False)

    # ---- loading ----------------------------------------------------------------------------------------------
    def retired(self, entry: ModelEntry) -> set[int]:
        """Versions a decided rollout took out of service (a promoted candidate's old primary, an aborted
        candidate): not loaded again after a restart or a reload."""
        record = read_state(entry.path) or {}
        leaving = {"promoted": "primary", "aborted": "candidate"}.get(record.get("state", ""))
        return {int(record[leaving])} if leaving else set()

    def loaded(self, entry: ModelEntry) -> None:
        """``entry`` was (re)loaded: take up its rollout from ``rollout.json`` or its config's ``[rollout]``."""
        name = entry.name
        versions = self.table.versions(name)
        self.by_model.pop(name, None)
        self.serving.pop(name, None)
        record = read_state(entry.path)
        configured = entry.config.rollout
        if record is not None and (not configured.candidate or configured.candidate == record.get("candidate")):
            state, candidate, primary = record.get("state"), int(record["candidate"]), int(record["primary"])
            if state == "promoted" and candidate in versions:
                self.serving[name] = candidate
                log.info("model %s: serving v%s, promoted over v%s (%s)", name, candidate, primary, STATE_FILE)
                return
            if state == "aborted" and primary in versions:
                self.serving[name] = primary
                log.info("model %s: serving v%s; candidate v%s was aborted (%s)", name, primary, candidate, STATE_FILE)
                return
            if state == "running" and candidate in versions and primary in versions:
                config = rollout_config(record.get("config", {}), f"{entry.path / STATE_FILE}")
                self._begin(name, primary, candidate, config)
                log.warning("model %s: the rollout of v%s beside v%s goes on after a restart or reload, its "
                            "comparison reset to zero samples (%s)", name, candidate, primary, STATE_FILE)  # fmt: skip
                return
        if configured.candidate:
            if configured.candidate not in versions:
                log.error("model %s: [rollout] candidate %s is not a loaded version (%s); no rollout", name,
                          configured.candidate, sorted(versions))  # fmt: skip
                return
            others = [v for v in versions if v != configured.candidate]
            if not others:
                log.error("model %s: [rollout] candidate %s has no version beside it to compare with", name,
                          configured.candidate)  # fmt: skip
                return
            primary = max(others)
            try:
                self._begin(name, primary, configured.candidate, configured)
            except VisionServeError as exc:
                log.error("model %s: [rollout] refused: %s; no rollout", name, exc)
                return
            log.info("model %s: %s of v%s beside v%s started from config.toml", name, configured.mode,
                     configured.candidate, primary)  # fmt: skip

    def _begin(self, name: str, primary: int, candidate: int, config: RolloutConfig) -> Rollout:
        engines = self.table.models[name]
        _check_judged(engines[primary], engines[candidate])
        rollout = Rollout(name, primary, candidate, config, task_for(engines[primary].spec).comparison(config))
        self.by_model[name] = rollout
        self.serving[name] = primary
        self._save(rollout)
        self.table.changed()
        return rollout

    # ---- the admin calls --------------------------------------------------------------------------------------
    async def start(self, name: str, raw: dict[str, Any]) -> dict[str, Any]:
        """Start a rollout of ``raw["candidate"]`` (loaded from the repository if it is not yet) beside the version
        serving now; ``raw`` holds any ``[rollout]`` fields."""
        if name not in self.table.models:
            raise NotFoundError(f"model {name!r} is not loaded here")
        current = self.by_model.get(name)
        if current is not None and current.running:
            raise BadInputError(f"model {name!r} already has a rollout running (v{current.candidate}); abort it first")
        config = rollout_config(raw, "the rollout request")
        if not config.candidate:
            raise BadInputError('a rollout needs a candidate version: {"candidate": N}')
        versions = self.table.models[name]
        primary = self.serving.get(name) or max(v for v in versions if v != config.candidate)
        if config.candidate == primary:
            raise BadInputError(f"version {primary} is the one serving; the candidate must be another")
        loaded_here = config.candidate not in versions
        if loaded_here:
            await self._load_candidate(name, config.candidate)
        try:
            rollout = self._begin(name, primary, config.candidate, config)
        except VisionServeError:  # it takes other input: what was loaded for it goes again
            if loaded_here:
                await self._close(self.table.versions(name).pop(config.candidate, None))
                self.residency.release_extra(VersionKey(name, config.candidate))
            raise
        log.info("model %s: %s of v%s beside v%s started by request", name, config.mode, config.candidate, primary)
        return rollout.document()

    async def _load_candidate(self, name: str, number: int) -> None:
        entry = await asyncio.to_thread(self.repository.model, name)
        version = entry.versions.get(number)
        if version is None:
            why = entry.version_errors.get(number)
            raise NotFoundError(f"model {name!r} has no usable version {number} in the repository"
                                + (f": {why}" if why else ""))  # fmt: skip
        entry = dataclasses.replace(entry, config=self.table.configs[name].config)

        async def load() -> None:
            self.table.models.setdefault(name, {})[number] = await self.make_engine(entry, number)

        await self.residency.load_extra(VersionKey(name, number), entry, load)

    async def decide(self, name: str, decision: str, reason: str) -> dict[str, Any]:
        """Promote or abort ``name``'s running rollout; the version leaving is unloaded once drained."""
        rollout = self.by_model.get(name)
        if rollout is None or not rollout.running:
            raise BadInputError(f"model {name!r} has no rollout running")
        await self._close(*self._decide(rollout, decision, reason))
        return rollout.document()

    def _decide(self, rollout: Rollout, decision: str, reason: str) -> tuple[ModelEngine | None, Charge | None]:
        """The decision, at once (no await: no request can slip between the decision and the new route); the
        version leaving and its memory charge are returned for the caller to drain and close."""
        name = rollout.model
        promote = decision == "promote"
        keep, leave = (rollout.candidate, rollout.primary) if promote else (rollout.primary, rollout.candidate)
        rollout.state = "promoted" if decision == "promote" else "aborted"
        rollout.reason = reason
        rollout.decided_unix = time.time()
        self.serving[name] = keep  # from here every request naming no version goes to ``keep``
        self._save(rollout)
        log.warning("model %s: v%s %s beside v%s: %s", name, rollout.candidate, rollout.state, rollout.primary, reason)
        leaving = self.table.versions(name).pop(leave, None)
        versions = len(self.table.versions(name)) + (leaving is not None)
        charge = self.residency.decided(name, VersionKey(name, rollout.candidate), promoted=promote, versions=versions)
        self.table.changed()
        return leaving, charge

    async def _close(self, leaving: ModelEngine | None, charge: Charge | None = None) -> None:
        async def close() -> None:
            if leaving is not None:
                await leaving.close(self.drain_timeout_s)  # its queued work is answered first

        await self.residency.close(charge, close)  # its memory is counted until it is closed

    # ---- requests -------------------------------------------------------------------------------------------
    def version_for(self, name: str, asked: int) -> int:
        """The version a request naming none goes to (``asked``: what its front end chose)."""
        serving = self.serving.get(name)
        return serving if serving is not None and serving in self.table.versions(name) else asked

    def submit(self, message: Submit, images: np.ndarray) -> asyncio.Future[InferResult] | None:
        """The answer's future for a request naming no version of a model with a running rollout; None when the
        model has none running, or when the primary alone answers this one (the caller queues it as usual, on the
        version serving)."""
        rollout = self.by_model.get(message.model)
        if rollout is None or not rollout.running:
            return None
        answer_v, other_v = rollout.arms(message.route or "")
        if other_v is None and answer_v != rollout.candidate:
            return None
        engines = self.table.models[message.model]
        # Its own copy, read by each arm (and a canary's rescue) however long: the caller's buffer is free at a cancel.
        images = np.array(images, copy=True)
        answer, other = engines[answer_v], engines.get(other_v) if other_v is not None else None
        shed = other is not None and _busy(answer, other)  # judged before the live images join the queue
        live = answer.batcher.enqueue(_request(message, images, message.priority, message.timeout_ms or None))
        beside: asyncio.Future[InferResult] | None = None
        if other is not None and not shed:
            copy = _request(message, images, SHADOW_PRIORITY, rollout.config.shadow_timeout_ms)
            try:
                beside = other.batcher.enqueue(copy)
            except VisionServeError:
                shed = True
        if other is not None:
            rollout.sampled(not shed)
            if shed:
                rollout.comparison.record_shed(len(images))
        canary = answer_v == rollout.candidate
        if beside is not None:
            self._spawn(self._compare(rollout, live, beside, len(images), candidate_answers=canary))
        if not canary:
            return live
        primary = engines[rollout.primary]

        def rescue() -> asyncio.Future[InferResult]:  # on the engine's copy of the images
            return primary.batcher.enqueue(_request(message, images, message.priority, message.timeout_ms or None))

        return asyncio.get_running_loop().create_task(self._canary(live, beside, rescue, answer_v))

    async def _canary(
        self,
        live: asyncio.Future[InferResult],
        beside: asyncio.Future[InferResult] | None,
        rescue: Callable[[], asyncio.Future[InferResult]],
        candidate: int,
    ) -> InferResult:
        """A canary's answer: the candidate's (its ``version`` says so), with what it failed answered by the primary
        (computed beside it for the comparison, or queued now; the primary's alone when the whole request failed)."""
        try:
            result = await asyncio.shield(live)
        except asyncio.CancelledError:
            live.cancel()
            if beside is not None:
                beside.cancel()
            raise
        except VisionServeError as exc:
            if isinstance(exc, BadInputError):
                raise
            return await asyncio.shield(beside if beside is not None else rescue())  # the whole request failed
        failed = [i for i, e in enumerate(result.errors) if e is not None and not isinstance(e, BadInputError)]
        result = dataclasses.replace(result, version=candidate)
        if not failed:
            return result
        try:
            primary = await asyncio.shield(beside if beside is not None else rescue())
        except VisionServeError:
            return result
        # Copies: the comparison reads the candidate's own answers.
        outputs, errors = {name: array.copy() for name, array in result.outputs.items()}, list(result.errors)
        for i in failed:
            if primary.errors[i] is None:
                errors[i] = None
                for name, array in outputs.items():
                    array[i] = primary.outputs[name][i]
        alone = len(failed) == len(errors) and all(e is None for e in errors)  # every row the primary's: it answered
        return dataclasses.replace(result, outputs=outputs, errors=errors, version=0 if alone else candidate)

    async def _compare(
        self,
        rollout: Rollout,
        live: asyncio.Future[InferResult],
        beside: asyncio.Future[InferResult],
        images: int,
        *,
        candidate_answers: bool,
    ) -> None:
        live_out, beside_out = await asyncio.gather(live, beside, return_exceptions=True)
        if isinstance(live_out, asyncio.CancelledError) or isinstance(beside_out, asyncio.CancelledError):
            return  # the caller went away
        if not rollout.running:
            return
        comparison = rollout.comparison
        if isinstance(beside_out, DeadlineExceededError | OverloadedError):
            comparison.record_shed(images)  # its deadline passed in the queue, or the queue was full
            return
        candidate, primary = (live_out, beside_out) if candidate_answers else (beside_out, live_out)
        if isinstance(primary, BaseException):
            return  # nothing to hold the candidate against
        comparison.attempts += images
        if isinstance(candidate, BaseException):
            comparison.record_error(str(candidate), images)
        else:
            ok = [i for i in range(images) if primary.errors[i] is None and candidate.errors[i] is None]
            bad = [e for i, e in enumerate(candidate.errors) if e is not None and primary.errors[i] is None]
            if bad:
                comparison.record_error(str(bad[-1]), len(bad))
            if ok:
                comparison.record(comparison.rows(primary, ok), comparison.rows(candidate, ok), _per_image(primary),
                                  _per_image(candidate), (_size(primary), _size(candidate)))  # fmt: skip
        rollout.verdict, rollout.verdict_reason = verdict(rollout.comparison, rollout.config)
        if rollout.config.auto and rollout.verdict != "wait" and rollout.running:
            self._spawn(self._close(*self._decide(rollout, rollout.verdict, f"automatic: {rollout.verdict_reason}")))

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("rollout task failed", exc_info=task.exception())

    async def control(self, call: RolloutQuery, lock: asyncio.Lock) -> dict[str, Any] | None:
        """The engine's rollout query: the document (None where the model is not here); with an ``action``:
        start, promote or abort first (under the engine's model lock, as loads and unloads)."""
        name, action = call.name, call.action
        if action is None:
            return self.document(name) if name in self.table.models or name in self.by_model else None
        async with lock:
            if action == "start":
                return await self.start(name, call.settings or {})
            if action in ("promote", "abort"):
                return await self.decide(name, action, call.reason or f"{action} asked by request")
        raise BadInputError(f"unknown rollout action {action!r}: start, promote or abort")

    def routes(self) -> dict[str, int]:
        """Per model, the version requests naming none are served by, where a rollout chose it."""
        return {name: v for name in self.table.models if (v := self.version_for(name, 0))}

    def sticky_headers(self) -> dict[str, str]:
        """Per model with a sticky canary running, the request header it routes by."""
        return {name: r.config.sticky_header for name, r in self.by_model.items()
                if r.running and r.config.mode == "canary" and r.config.sticky_header}  # fmt: skip

    # ---- what it shows --------------------------------------------------------------------------------------
    def document(self, name: str) -> dict[str, Any]:
        rollout = self.by_model.get(name)
        if rollout is None:
            if name not in self.table.models:
                raise NotFoundError(f"unknown model {name!r}")
            return {"model": name, "state": "none", "serving": self.version_for(name, max(self.table.models[name]))}
        return rollout.document()

    def documents(self) -> list[dict[str, Any]]:
        return [r.document() for r in list(self.by_model.values())]

    def _save(self, rollout: Rollout) -> None:
        entry = self.table.configs.get(rollout.model)
        if entry is not None:
            write_state(rollout, entry.path)


def _check_judged(primary: ModelEngine, candidate: ModelEngine) -> None:
    """A rollout compares both versions' answers on the same decoded image: the same task (and a detector's output
    layout) on the same input."""
    a, b = primary.spec, candidate.spec
    if (a.task, a.output_layout) != (b.task, b.output_layout):
        raise BadInputError(
            f"v{candidate.version.version} of {a.name!r} is a {b.task} model ({b.output_layout or 'logits'}) beside "
            f"v{primary.version.version}'s {a.task} ({a.output_layout or 'logits'}): a rollout compares answers "
            "of one kind"
        )
    if a.input != b.input or (a.resize_size, a.interpolation) != (b.resize_size, b.interpolation):
        raise BadInputError(
            f"v{candidate.version.version} takes other input than v{primary.version.version} "
            f"({b.input} vs {a.input}): a rollout compares both on the same decoded image"
        )


def _busy(answer: ModelEngine, other: ModelEngine) -> bool:
    """Whether shadow work now would compete with live work: live images are waiting for the answering version
    (its queue is not empty), or the shadow's version is still busy with earlier work. Both versions share the
    device's cores (or SMs): a shadow batch computing beside a live one slows it, so at most one runs at a time,
    and none while live work queues. Under load this sheds most samples: the sampling backs off by itself."""
    return answer.batcher.queue_depth > 0 or other.batcher.queue_depth > 0 or other.batcher.inflight_batches > 0


def _request(message: Submit, images: np.ndarray, priority: int, timeout_ms: float | None) -> InferRequest:
    return InferRequest(request_id=message.request_id, model=message.model, version=message.version, images=images,
                        priority=priority, timeout_ms=timeout_ms)  # fmt: skip


def _size(result: InferResult) -> int:
    return max(1, result.batch_sizes[-1] if result.batch_sizes else len(result.errors))


def _per_image(result: InferResult) -> float:
    return result.compute_s / _size(result)
