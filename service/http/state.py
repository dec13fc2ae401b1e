"""What the server holds while it runs: a loaded engine and decoding pool per model version, and readiness.

Owned by the app's lifespan: models load (off the event loop) before the server reports ready, and close
(draining their queues) when it stops. A model that fails to load is recorded and never stops the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from service.batching import InferRequest, InferResult
from service.batching.engine import ModelEngine
from service.config import ModelConfig
from service.decoding import Decoded, Preprocessor
from service.errors import (
    BadInputError,
    CancelledError,
    ConfigError,
    DeadlineExceededError,
    NotFoundError,
    OverloadedError,
    VisionServeError,
)
from service.metrics import NOT_OBSERVED, Metrics
from service.preprocess import ImageLimits
from service.repository import ModelEntry, ModelRepository, ModelVersion
from service.settings import ServerSettings
from service.spec import ModelSpec

log = logging.getLogger("visionserve.server")


@dataclass
class Timing:
    """Seconds spent per stage for one request (Server-Timing and the access log)."""

    preprocess_s: float = 0.0
    queue_s: float = 0.0
    compute_s: float = 0.0
    postprocess_s: float = 0.0

    def header(self, total_s: float | None = None) -> str:
        parts = [
            f"queue;dur={self.queue_s * 1000:.3f}",
            f"preprocess;dur={self.preprocess_s * 1000:.3f}",
            f"compute;dur={self.compute_s * 1000:.3f}",
            f"postprocess;dur={self.postprocess_s * 1000:.3f}",
        ]
        if total_s is not None:
            parts.append(f"total;dur={total_s * 1000:.3f}")
        return ", ".join(parts)


@dataclass
class ModelStats:
    """Counts and cumulative durations per model version (the v2 statistics extension)."""

    success: int = 0
    failure: int = 0
    images: int = 0
    queue_ns: int = 0
    compute_ns: int = 0
    preprocess_ns: int = 0
    last_inference_ms: int = 0
    batch_counts: dict[int, int] = field(default_factory=dict)


def outcome_of(exc: BaseException) -> str:
    if isinstance(exc, asyncio.CancelledError | CancelledError):
        return "cancelled"
    if isinstance(exc, OverloadedError):
        return "rejected"
    if isinstance(exc, DeadlineExceededError):
        return "timeout"
    if isinstance(exc, BadInputError):
        return "bad_input"
    return "error"


class ModelSlot:
    """One served model version."""

    def __init__(
        self,
        entry: ModelEntry,
        version: ModelVersion,
        engine: ModelEngine,
        pool: Preprocessor,
        metrics: Metrics | None = None,
    ) -> None:
        self.entry = entry
        self.version = version
        self.engine = engine
        self.pool = pool
        self.stats = ModelStats()
        self._labels = (version.model, str(version.version), ",".join(engine.state().devices))
        self._recorder = metrics.request_recorder(*self._labels) if metrics is not None else None

    @contextlib.contextmanager
    def observe(self, timing: Timing) -> Iterator[None]:
        """Record one request's outcome and stage durations, once, however it ends."""
        started = time.perf_counter()
        outcome = "success"
        try:
            yield
        except BaseException as exc:
            outcome = outcome_of(exc)
            raise
        finally:
            if self._recorder is not None:
                done = outcome == "success"
                self._recorder.record(
                    outcome,
                    time.perf_counter() - started,
                    timing.preprocess_s or NOT_OBSERVED,
                    timing.queue_s if done else NOT_OBSERVED,
                    timing.postprocess_s if done else NOT_OBSERVED,
                )

    @property
    def name(self) -> str:
        return self.version.model

    @property
    def spec(self) -> ModelSpec:
        return self.version.spec

    @property
    def config(self) -> ModelConfig:
        return self.entry.config

    async def decode(self, images: list[bytes], timing: Timing) -> list[Decoded]:
        """Decode each image in the pool; a refused image becomes its own error."""
        started = time.perf_counter()
        futures = [asyncio.wrap_future(self.pool.submit(data)) for data in images]
        results: list[Decoded] = []
        for future in futures:
            try:
                results.append(await future)
            except VisionServeError as exc:
                results.append(exc)
        timing.preprocess_s += time.perf_counter() - started
        return results

    async def infer(
        self, images: np.ndarray, timing: Timing, *, priority: int = 0, timeout_ms: float | None = None
    ) -> InferResult:
        """Run a uint8 batch through the batcher; the model's queue_full_status rides on an overload error."""
        request = InferRequest(
            request_id=uuid.uuid4().hex, model=self.name, version=self.version.version, images=images,
            priority=priority, timeout_ms=timeout_ms,
        )  # fmt: skip
        try:
            result = await self.engine.submit(request)
        except OverloadedError as exc:
            exc.status = self.config.queue_full_status  # type: ignore[attr-defined]
            self.stats.failure += 1
            raise
        except VisionServeError:
            self.stats.failure += 1
            raise
        timing.queue_s += result.queue_s
        timing.compute_s += result.compute_s
        stats = self.stats
        stats.success += 1
        stats.images += len(images)
        stats.queue_ns += int(result.queue_s * 1e9)
        stats.compute_ns += int(result.compute_s * 1e9)
        stats.preprocess_ns += int(timing.preprocess_s * 1e9)
        stats.last_inference_ms = int(time.time() * 1000)
        return result

    async def close(self, timeout_s: float) -> None:
        await self.engine.close(timeout_s)
        self.pool.close()


class ServerState:
    """Every loaded model version, the repository's refusals, and whether the server is ready."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.repository = ModelRepository(settings.repository)
        self.slots: dict[str, dict[int, ModelSlot]] = {}
        self.errors: dict[str, str] = {}
        self.ready = False
        self.draining = False
        self.started_at = time.time()
        self.limits = ImageLimits(max_pixels=settings.max_pixels)
        self._lock = asyncio.Lock()
        self.metrics = Metrics() if settings.metrics else None
        if self.metrics is not None:
            self.metrics.watch(self._live)

    def _live(self) -> Iterable[tuple[tuple[str, str, str], int, int]]:
        for versions in list(self.slots.values()):
            for slot in versions.values():
                batcher = slot.engine.batcher
                yield slot._labels, batcher.queue_depth, batcher.inflight_batches

    async def start(self) -> None:
        index = await asyncio.to_thread(self.repository.scan)
        self.errors.update(index.errors)
        for name in index.models:
            await self._load(index.models[name])
        self.ready = True
        log.info("ready: %s", ", ".join(self.slots) or "no models")

    async def _load(self, entry: ModelEntry) -> None:
        loaded: dict[int, ModelSlot] = {}
        for number, version in sorted(entry.versions.items()):
            observer = on_fallback = None
            if self.metrics is not None:
                observer = self.metrics.batch_observer(entry.name, number)
                on_fallback = self.metrics.fallback_hook(entry.name, number, lambda: "cpu")
            try:
                engine = await asyncio.to_thread(
                    ModelEngine, version, entry.config, observer=observer, on_fallback=on_fallback
                )
            except (ConfigError, VisionServeError) as exc:
                log.error("model %s version %s failed to load: %s", entry.name, number, exc)
                self.errors[f"{entry.name}/{number}"] = str(exc)
                continue
            pool = Preprocessor(version.spec, self.limits, workers=self.settings.decode_workers)
            loaded[number] = ModelSlot(entry, version, engine, pool, self.metrics)
            state = engine.state()
            log.info("loaded %s v%s: %s on %s%s", entry.name, number, state.backend, ",".join(state.devices),
                     f" ({state.note})" if state.note else "")  # fmt: skip
        if loaded:
            self.slots[entry.name] = loaded
            self.errors.pop(entry.name, None)

    def slot(self, name: str, version: int | str | None = None) -> ModelSlot:
        versions = self.slots.get(name)
        if not versions:
            reason = self.errors.get(name)
            raise NotFoundError(f"unknown model {name!r}" + (f" (refused at load: {reason})" if reason else ""))
        if version in (None, ""):
            return versions[max(versions)]
        try:
            number = int(version)
        except (TypeError, ValueError):
            raise BadInputError(f"model version must be a positive integer, got {version!r}") from None
        if number not in versions:
            raise NotFoundError(f"model {name!r} has no version {number} (versions: {sorted(versions)})")
        return versions[number]

    async def load_model(self, name: str) -> None:
        async with self._lock:
            entry = await asyncio.to_thread(self.repository.model, name)
            old = self.slots.pop(name, None)
            await self._load(entry)
            if old:
                for slot in old.values():
                    await slot.close(self.settings.drain_timeout_s)
            if name not in self.slots:
                reasons = [e for key, e in self.errors.items() if key.startswith(f"{name}/")]
                raise ConfigError(f"model {name!r} failed to load: {'; '.join(reasons) or 'see the log'}")

    async def unload_model(self, name: str) -> None:
        async with self._lock:
            old = self.slots.pop(name, None)
            if old is None:
                raise NotFoundError(f"model {name!r} is not loaded")
            for slot in old.values():
                await slot.close(self.settings.drain_timeout_s)

    async def close(self) -> None:
        self.ready = False
        self.draining = True
        for versions in list(self.slots.values()):
            for slot in versions.values():
                await slot.close(self.settings.drain_timeout_s)
        self.slots.clear()
