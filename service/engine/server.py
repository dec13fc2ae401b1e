"""The engine process's work: every model version of the repository loaded on this engine's device, fed by the
front ends through the transport.

One ``ModelEngine`` per model version (its runtime instances behind one batcher), so batches form across every
front end. Requests and their stage timings are recorded by the front ends; this process records batches and
compute, gathers the front ends' cumulative reports when a scrape or a stats call asks, and renders the whole
server's metrics, so any front end answers for all of them with nothing counted twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

import numpy as np

from service.core.errors import (
    BadInputError,
    CancelledError,
    ConfigError,
    DeadlineExceededError,
    MemoryBudgetError,
    NotFoundError,
    OverloadedError,
    VisionServeError,
)
from service.core.memory_metrics import ResidencyCollector
from service.core.metrics import LiveState, Metrics
from service.core.repository import ModelEntry, ModelRepository, with_config
from service.core.rollout_metrics import RolloutCollector
from service.core.settings import ServerSettings, parse_budget
from service.core.source_metrics import SourceCollector
from service.core.status import SERVING_STATES
from service.core.stream_metrics import StreamCollector
from service.engine import views
from service.engine.batcher import InferRequest, InferResult
from service.engine.model import ModelEngine, cuda_devices, engine_share, home_device
from service.engine.ondemand import Residency
from service.engine.pending import Release
from service.engine.rollout import Rollouts
from service.engine.table import ModelTable
from service.transport.messages import (
    CatalogQuery,
    ControlQuery,
    Failed,
    HoldQuery,
    IndexQuery,
    LoadQuery,
    MetricsQuery,
    Result,
    RolloutQuery,
    Snapshot,
    Stamps,
    StatsQuery,
    Submit,
    Tensor,
    UnloadQuery,
    VersionKey,
    WireError,
)

log = logging.getLogger("visionserve.engine")


class Endpoint(Protocol):
    """Where the engine's answers go: the transport's :class:`~service.transport.server.EngineEndpoint` across
    processes, or an in-process one (``service.inprocess``)."""

    name: str
    snapshots: dict[bytes, Snapshot]  # the latest report of each front end

    def send(self, peer: bytes, message: Any) -> None: ...

    def announce(self) -> None: ...

    def live_peer(self, peer: bytes) -> bool: ...

    async def flush(self, timeout_s: float = 0.5) -> None: ...


class EngineServer:
    """Loads the repository's models and answers the front ends (the transport's ``Handler``). It builds the model
    table and hands it, with what else each needs, to on-demand residency and to rollouts; neither holds it."""

    def __init__(
        self, settings: ServerSettings, endpoint: Endpoint, *, gpus: list[str] | None = None, primary: bool = True
    ) -> None:
        self.settings = settings
        self.endpoint = endpoint
        self.gpus = gpus  # None: every usable GPU (or the CPU); else only these (checked in load_all)
        self.machine_gpus: list[str] = []  # every usable GPU of the machine, when this engine is one of several
        self.primary = primary
        self.repository = ModelRepository(settings.repository)
        self.table = ModelTable(endpoint.announce)
        self._pending: dict[tuple[bytes, int], asyncio.Future[InferResult]] = {}
        self._lock = asyncio.Lock()
        self.draining = False
        # Every engine hears every front end's report; only the primary renders them, so nothing counts twice.
        reported = self._reported if primary else lambda field: []
        self.metrics = Metrics(request_states=lambda: reported("requests")) if settings.metrics else None
        self.residency = Residency(
            self.table, self.load_versions, parse_budget(settings.memory_budget),
            place=lambda entry: home_device(entry.config, self.gpus), primary=primary,
            drain_timeout_s=settings.drain_timeout_s, min_residency_s=settings.min_residency_s,
            max_parallel_loads=settings.max_parallel_loads, cold_start_limit_s=settings.cold_start_limit_s,
        )  # fmt: skip
        self.residency.live_peer = endpoint.live_peer
        self.rollouts = Rollouts(
            self.table,
            self.residency,
            self.repository,
            lambda entry, number: self.make_engine(entry, number, self.gpus),
            drain_timeout_s=settings.drain_timeout_s,
        )
        if self.metrics is not None:
            self.metrics.watch(self._live)
            self.metrics.registry.register(ResidencyCollector(self.residency.snapshot))
            self.metrics.registry.register(RolloutCollector(self.rollouts.documents))
            self.metrics.registry.register(StreamCollector(lambda: reported("streams")))
            self.metrics.registry.register(SourceCollector(lambda: reported("sources")))

    # ---- loading --------------------------------------------------------------------------------------------
    async def load_all(self) -> None:
        if self.gpus is not None:  # the supervisor counted device files; keep the GPUs torch can really use
            usable = await asyncio.to_thread(cuda_devices)
            self.machine_gpus = usable
            self.gpus = [g for g in self.gpus if g in usable]
        index = await asyncio.to_thread(self.repository.scan)
        self.table.errors.update(index.errors)
        for name in sorted(index.models):
            entry = index.models[name]
            if self.gpus is not None and engine_share(entry.config, self.gpus, self.machine_gpus,
                                                      primary=self.primary) is None:  # fmt: skip
                continue  # another engine serves it
            if entry.config.residency == "on_demand":
                self.residency.offer(entry)
            else:
                await self._load_charged(entry, "startup")
        log.info("engine %s ready: %s", self.endpoint.name, ", ".join(self.table.models) or "no models")

    async def load_versions(self, entry: ModelEntry) -> None:
        """Load every version of ``entry`` that this engine serves into the table (the loader residency is given);
        a version that fails is unavailable with its reason, the others serve."""
        gpus = self.gpus
        if gpus is not None:
            share = engine_share(entry.config, gpus, self.machine_gpus, primary=self.primary)
            if share is None:
                return  # another engine serves it
            gpus = share
        loaded: dict[int, ModelEngine] = {}
        retired = self.rollouts.retired(entry)
        for number in sorted(entry.versions):
            if number in retired and len(entry.versions) > 1:
                log.info("model %s v%s not loaded: a rollout took it out of service (%s)", entry.name, number,
                         "rollout.json")  # fmt: skip
                continue
            try:
                engine = await self.make_engine(entry, number, gpus)
            except VisionServeError as exc:
                log.error("model %s version %s failed to load: %s", entry.name, number, exc)
                self._load_failed(VersionKey(entry.name, number), str(exc))
                continue
            except Exception as exc:  # a runtime's own exception nobody translated: reported, never lost
                log.exception("model %s version %s failed to load with an unexpected error", entry.name, number)
                self._load_failed(VersionKey(entry.name, number), f"{type(exc).__name__}: {exc}")
                continue
            loaded[number] = engine
            state = engine.state()
            log.info("loaded %s v%s: %s on %s%s", entry.name, number, state.backend, ",".join(state.devices),
                     f" ({state.note})" if state.note else "")  # fmt: skip
        if loaded:
            self.table.put(entry, loaded)
            try:
                self.rollouts.loaded(entry)
            except VisionServeError as exc:
                log.error("model %s: its rollout was not started: %s", entry.name, exc)
        self.table.changed()

    async def make_engine(self, entry: ModelEntry, number: int, gpus: list[str] | None) -> ModelEngine:
        """Load and warm up one version (off the event loop), observed by the metrics."""
        observer = on_fallback = None
        if self.metrics is not None:
            observer = self.metrics.batch_observer(entry.name, number)
            on_fallback = self.metrics.fallback_hook(entry.name, number, lambda: "cpu")
        # A state the engine changes tells the front ends through on_state_change, metrics or none (a load's own
        # caller tells them when it ends).
        return await asyncio.to_thread(
            ModelEngine, entry.versions[number], entry.config, available_gpus=gpus, observer=observer,
            on_fallback=on_fallback, on_state_change=self.table.changed,
        )  # fmt: skip

    async def _load_charged(self, entry: ModelEntry, reason: str) -> None:
        """Load ``entry`` and charge it to its device's memory budget (evicting on-demand models for room)."""
        try:
            await self.residency.load(entry, reason)
        except VisionServeError as exc:
            if not self.table.has_errors(entry.name):
                log.error("model %s not loaded: %s", entry.name, exc)
                self.table.failed(entry.name, str(exc))

    def _load_failed(self, key: VersionKey, reason: str) -> None:
        """A version that did not load: unavailable with its reason (the index, metadata, the log) and counted."""
        self.table.failed(key, reason)
        if self.metrics is not None:
            self.metrics.load_failures.labels(key.name, str(key.version)).inc()

    # ---- the transport's handler ----------------------------------------------------------------------------
    def catalog_version(self) -> int:
        return self.table.version

    def submit(self, peer: bytes, message: Submit, images: np.ndarray) -> None:
        # How the front end learns that no batch reads the pixels any more where no answer says so (it keeps them
        # until then); Release decides when.
        released = Release(lambda why: self.endpoint.send(peer, Failed(message.id, WireError.of(CancelledError(why)))))
        version = message.version
        try:
            if self.draining:
                raise OverloadedError("the server is shutting down")
            if message.model not in self.table.models and message.model in self.residency.on_demand:
                future: asyncio.Future[InferResult] = asyncio.get_running_loop().create_task(
                    self._cold(message, images, released)
                )
            else:
                self.residency.hit(message.model)
                routed = self.rollouts.submit(message, images) if message.route is not None else None
                if message.route is not None:  # named no version: the one serving (a rollout may have chosen it)
                    version = self.rollouts.version_for(message.model, version)
                # A rollout computes on its own copy of the pixels; others are queued on the sender's.
                future = routed if routed is not None else self._enqueue(message, images, version, released)
        except VisionServeError as exc:
            self.endpoint.send(peer, Failed(message.id, self._wire(exc, message.model)))
            return
        key = (peer, message.id)
        self._pending[key] = future
        future.add_done_callback(lambda f: self._answer(key, message.model, f, released, version))

    def _enqueue(
        self, message: Submit, images: np.ndarray, version: int, released: Release, timeout_ms: float | None = None
    ) -> asyncio.Future[InferResult]:
        request = InferRequest(
            request_id=message.request_id, model=message.model, version=version, images=images,
            priority=message.priority, timeout_ms=timeout_ms if timeout_ms is not None else message.timeout_ms or None,
        )  # fmt: skip
        return self.table.engine(message.model, version).batcher.enqueue(request, on_released=released)

    async def _cold(self, message: Submit, images: np.ndarray, released: Release) -> InferResult:
        """A request for an on-demand model that is not resident: it waits for the model's one load, then queues."""
        started = time.monotonic()
        deadline = started + message.timeout_ms / 1000.0 if message.timeout_ms else None
        # Again if it went before this request got to it (an unload or reload by the repository API).
        while message.model not in self.table.models:
            await self.residency.wait_for(message.model, deadline)
            if self.draining:
                raise OverloadedError("the server is shutting down")
            if deadline is not None and time.monotonic() >= deadline:
                raise DeadlineExceededError(f"the deadline passed while model {message.model!r} loaded")
        waited = time.monotonic() - started
        left_ms = message.timeout_ms - waited * 1000.0 if message.timeout_ms else None
        result = await self._enqueue(message, images, message.version, released, left_ms)
        result.cold_start_s = waited
        return result

    def _answer(
        self, key: tuple[bytes, int], model: str, future: asyncio.Future[InferResult], released: Release, version: int
    ) -> None:
        """Send the request's answer (``version``: the one that computed it, unless the result names another), or,
        cancelled, none: every path's end, and its region's release, decided here."""
        self._pending.pop(key, None)
        peer, number = key
        if future.cancelled():
            released.cancelled()  # the front end no longer waits: no answer, the region freed once unread
            return
        exc = future.exception()
        if exc is not None:
            held = released.answered(error=True)  # held: a batch still reads the pixels, a release follows
            self.endpoint.send(peer, Failed(number, self._wire(exc, model), held=held))
            return
        released.answered(error=False)
        result = future.result()
        errors = [None if e is None else WireError.of(e) for e in result.errors]
        outputs = [Tensor.of(name, array) for name, array in result.outputs.items()]
        stamps = Stamps(result.received, result.instance, result.batch, result.done)
        self.endpoint.send(peer, Result(number, outputs, errors if any(errors) else None,
                                        result.queue_s, result.compute_s, result.batch_sizes, stamps,
                                        result.cold_start_s, result.version or version))  # fmt: skip

    def _wire(self, exc: BaseException, model: str) -> WireError:
        wire = WireError.of(exc)
        entry = self.table.configs.get(model)
        if isinstance(exc, OverloadedError) and not isinstance(exc, MemoryBudgetError) and entry and not wire.status:
            wire = WireError(wire.kind, wire.message, entry.config.queue_full_status)
        return wire

    def cancel(self, peer: bytes, request: int) -> None:
        future = self._pending.get((peer, request))
        if future is not None:
            future.cancel()

    # ---- control queries ------------------------------------------------------------------------------------
    async def query(self, peer: bytes, call: ControlQuery) -> Any:
        """Answer one control call (its value as the :class:`~service.transport.messages.Reply` carries it)."""
        if isinstance(call, CatalogQuery):
            return views.catalog(self.table, self.residency, self.rollouts)
        if isinstance(call, MetricsQuery):
            if self.metrics is None:
                raise NotFoundError("metrics are off (--no-metrics)")
            await self.endpoint.flush()
            # Rendered off the event loop: with 40 models the text is ~4 MB and took 0.3-1.2 s, during which this
            # engine answered nothing (a scrape every 0.5 s took another client's p99 from 26 to 200 ms). In a
            # thread the loop still runs between the renderer's GIL slices. The recorders fold under their own locks.
            return await asyncio.to_thread(self.metrics.render)
        if isinstance(call, StatsQuery):
            await self.endpoint.flush()
            return views.stats(self.table, list(self.endpoint.snapshots.values()))
        if isinstance(call, IndexQuery):
            try:
                names = await asyncio.to_thread(self.repository.model_names)
            except ConfigError as exc:
                log.error("repository index: %s", exc)
                names = []
            return views.index(names, self.table, self.residency)
        if isinstance(call, LoadQuery):
            return await self._load_model(call.name, call.config)
        if isinstance(call, UnloadQuery):
            return await self._unload_model(call.name)
        if isinstance(call, RolloutQuery):
            return await self.rollouts.control(call, self._lock)
        if isinstance(call, HoldQuery):
            return self.residency.hold(call.name, (peer, call.holder), call.hold)
        raise BadInputError(f"unknown query {type(call).__name__}")

    async def _load_model(self, name: str, override: Any) -> Any:
        async with self._lock:
            entry = await asyncio.to_thread(self.repository.model, name)
            if override is not None:
                entry = with_config(entry, override)
            await self.residency.settle(name)  # an on-demand load of it in progress goes first
            old = self.table.models.pop(name, None)
            self.table.forget_errors(name)
            with self.residency.leaving(name):  # the old copy holds its memory until it is closed
                await self._load_charged(entry, "explicit")
                for engine in (old or {}).values():
                    await engine.close(self.settings.drain_timeout_s)
            self.residency.reoffer(entry)  # on demand or not, as its config now says (a config sent may change it)
            if name not in self.table.models:
                reasons = self.table.version_errors(name)
                raise ConfigError(f"model {name!r} failed to load: {'; '.join(reasons) or 'see the log'}")
        return {"name": name, "state": "READY"}

    async def _unload_model(self, name: str) -> Any:
        async with self._lock:
            if name in self.residency.on_demand:  # out of memory, still available: its next request loads it
                await self.residency.settle(name)  # a load of it in progress first, or it would stay resident
                await self.residency.evict(name, "unloaded by request", reason="unload")
                return {"name": name, "state": "AVAILABLE"}
            old = self.table.models.pop(name, None)
            if old is None:
                if name not in await asyncio.to_thread(self.repository.model_names):
                    raise NotFoundError(f"no model {name!r} in the repository")
                return {"name": name, "state": "UNAVAILABLE"}  # unloading an unloaded model is not an error
            self.residency.unloaded(name)
            self.rollouts.by_model.pop(name, None)  # its rollout goes with it
            self.table.unloaded[name] = "unloaded by request"
            self.table.changed()
            for engine in old.values():
                await engine.close(self.settings.drain_timeout_s)
        return {"name": name, "state": "UNAVAILABLE"}

    # ---- metrics --------------------------------------------------------------------------------------------
    def _reported(self, field: str) -> list[Any]:
        """Every front end's latest report of ``field`` (requests, streams): the collectors merge them."""
        return [item for snap in list(self.endpoint.snapshots.values()) for item in getattr(snap, field)]

    def _live(self) -> Any:
        for name, versions in list(self.table.models.items()):  # read on a scrape's thread: copies, not live views
            for number, engine in list(versions.items()):
                batcher = engine.batcher
                state = engine.state()
                labels = (name, str(number), ",".join(state.devices))
                precision = state.precision + ("-ungated" if state.ungated else "")
                yield LiveState(labels, batcher.queue_depth, batcher.inflight_batches,
                                state.state in SERVING_STATES, batcher.stuck_total, state.backend,
                                precision)  # fmt: skip

    # ---- shutdown -------------------------------------------------------------------------------------------
    async def drain(self) -> None:
        """Refuse new work, finish what is queued (within the drain timeout), close every model."""
        self.draining = True
        deadline = time.monotonic() + self.settings.drain_timeout_s
        loads = list(self.residency.loading())
        if loads:  # a model loading now is closed with the others once loaded (its waiters are then refused)
            await asyncio.wait(loads, timeout=max(0.1, deadline - time.monotonic()))
        for versions in list(self.table.models.values()):
            for engine in versions.values():
                await engine.close(max(0.1, deadline - time.monotonic()))
