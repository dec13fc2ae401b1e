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

import msgspec
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
from service.core.metrics import LiveState, Metrics, ModelCounts
from service.core.repository import ModelEntry, ModelRepository, with_config
from service.core.rollout_metrics import RolloutCollector
from service.core.settings import ServerSettings, parse_budget
from service.core.spec import encode_spec
from service.core.status import SERVING_STATES
from service.core.stream_metrics import StreamCollector
from service.engine.batcher import InferRequest, InferResult
from service.engine.model import ModelEngine, cuda_devices, engine_share
from service.engine.ondemand import Residency
from service.engine.pending import Release
from service.engine.rollout import Rollouts
from service.transport.messages import Catalog, Failed, ModelInfo, Query, Result, Snapshot, Stamps, Submit, WireError

log = logging.getLogger("visionserve.engine")


class Endpoint(Protocol):
    """Where the engine's answers go: the transport's :class:`~service.transport.server.EngineEndpoint` across
    processes, or an in-process one (``service.inprocess``)."""

    name: str
    snapshots: dict[bytes, Snapshot]  # the latest report of each front end

    def send(self, peer: bytes, message: Any) -> None: ...

    def announce(self) -> None: ...

    async def flush(self, timeout_s: float = 0.5) -> None: ...


class EngineServer:
    """Loads the repository's models and answers the front ends (the transport's ``Handler``)."""

    def __init__(
        self, settings: ServerSettings, endpoint: Endpoint, *, gpus: list[str] | None = None, primary: bool = True
    ) -> None:
        self.settings = settings
        self.endpoint = endpoint
        self.gpus = gpus  # None: every usable GPU (or the CPU); else only these (checked in load_all)
        self.machine_gpus: list[str] = []  # every usable GPU of the machine, when this engine is one of several
        self.primary = primary
        self.repository = ModelRepository(settings.repository)
        self.models: dict[str, dict[int, ModelEngine]] = {}
        self.configs: dict[str, ModelEntry] = {}
        self.errors: dict[str, str] = {}
        self.unloaded: dict[str, str] = {}
        self._version = 1
        self._pending: dict[tuple[bytes, int], asyncio.Future[InferResult]] = {}
        self._lock = asyncio.Lock()
        self.draining = False
        # Every engine hears every front end's report; only the primary renders them, so nothing counts twice.
        reported = self._reported if primary else lambda field: []
        self.metrics = Metrics(request_states=lambda: reported("requests")) if settings.metrics else None
        self.residency = Residency(
            self, parse_budget(settings.memory_budget), min_residency_s=settings.min_residency_s,
            max_parallel_loads=settings.max_parallel_loads, cold_start_limit_s=settings.cold_start_limit_s,
        )  # fmt: skip
        self.rollouts = Rollouts(self)
        if self.metrics is not None:
            self.metrics.watch(self._live)
            self.metrics.registry.register(ResidencyCollector(self.residency.snapshot))
            self.metrics.registry.register(RolloutCollector(self.rollouts.documents))
            self.metrics.registry.register(StreamCollector(lambda: reported("streams")))

    # ---- loading --------------------------------------------------------------------------------------------
    async def load_all(self) -> None:
        if self.gpus is not None:  # the supervisor counted device files; keep the GPUs torch can really use
            usable = await asyncio.to_thread(cuda_devices)
            self.machine_gpus = usable
            self.gpus = [g for g in self.gpus if g in usable]
        index = await asyncio.to_thread(self.repository.scan)
        self.errors.update(index.errors)
        for name in sorted(index.models):
            entry = index.models[name]
            if self.gpus is not None and engine_share(entry.config, self.gpus, self.machine_gpus,
                                                      primary=self.primary) is None:  # fmt: skip
                continue  # another engine serves it
            if entry.config.residency == "on_demand":
                self.residency.offer(entry)
            else:
                await self._load_charged(entry, "startup")
        log.info("engine %s ready: %s", self.endpoint.name, ", ".join(self.models) or "no models")

    async def _load(self, entry: ModelEntry) -> None:
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
                self._load_failed(entry.name, number, str(exc))
                continue
            except Exception as exc:  # a runtime's own exception nobody translated: reported, never lost
                log.exception("model %s version %s failed to load with an unexpected error", entry.name, number)
                self._load_failed(entry.name, number, f"{type(exc).__name__}: {exc}")
                continue
            loaded[number] = engine
            state = engine.state()
            log.info("loaded %s v%s: %s on %s%s", entry.name, number, state.backend, ",".join(state.devices),
                     f" ({state.note})" if state.note else "")  # fmt: skip
        if loaded:
            self.models[entry.name] = loaded
            self.configs[entry.name] = entry
            self.errors.pop(entry.name, None)
            self.unloaded.pop(entry.name, None)
            try:
                self.rollouts.loaded(entry)
            except VisionServeError as exc:
                log.error("model %s: its rollout was not started: %s", entry.name, exc)
        self._version += 1

    async def make_engine(self, entry: ModelEntry, number: int, gpus: list[str] | None) -> ModelEngine:
        """Load and warm up one version (off the event loop), observed by the metrics."""
        observer = on_fallback = None
        if self.metrics is not None:
            observer = self.metrics.batch_observer(entry.name, number)
            hook = self.metrics.fallback_hook(entry.name, number, lambda: "cpu")
            on_fallback = self._on_fallback(hook)
        return await asyncio.to_thread(
            ModelEngine, entry.versions[number], entry.config, available_gpus=gpus, observer=observer,
            on_fallback=on_fallback, on_state_change=self._state_changed,
        )  # fmt: skip

    async def _load_charged(self, entry: ModelEntry, reason: str) -> None:
        """Load ``entry`` and charge it to its device's memory budget (evicting on-demand models for room)."""
        try:
            await self.residency.load(entry, reason)
        except VisionServeError as exc:
            if not any(k == entry.name or k.startswith(f"{entry.name}/") for k in self.errors):
                log.error("model %s not loaded: %s", entry.name, exc)
                self.errors[entry.name] = str(exc)

    def _load_failed(self, name: str, number: int, reason: str) -> None:
        """A version that did not load: unavailable with its reason (the index, metadata, the log) and counted."""
        self.errors[f"{name}/{number}"] = reason
        if self.metrics is not None:
            self.metrics.load_failures.labels(name, str(number)).inc()

    def _state_changed(self) -> None:
        self._version += 1  # a model's state changed (stuck, replaced, unhealthy): front ends re-read the catalog
        self.endpoint.announce()  # now, not at the next beat

    def _on_fallback(self, hook: Any) -> Any:
        def on_fallback(reason: str) -> None:
            hook(reason)
            self._version += 1  # the model's state changed: front ends re-read the catalog

        return on_fallback

    # ---- the transport's handler ----------------------------------------------------------------------------
    def catalog_version(self) -> int:
        return self._version

    def submit(self, peer: bytes, message: Submit, images: np.ndarray) -> None:
        try:
            if self.draining:
                raise OverloadedError("the server is shutting down")
            if message.model not in self.models and message.model in self.residency.on_demand:
                self._submit_cold(peer, message, images)
                return
            self.residency.hit(message.model)
            released = self._releaser(peer, message.id)
            future = self.rollouts.submit(message, images) if message.route is not None else None
            version = message.version
            if message.route is not None:  # named no version: the one serving (a rollout may have chosen it)
                version = self.rollouts.version_for(message.model, version)
            if future is not None:  # a rollout computes on its own copy of the pixels: free at a cancel
                future.add_done_callback(lambda f: released() if f.cancelled() else None)
            else:
                request = InferRequest(
                    request_id=message.request_id, model=message.model, version=version, images=images,
                    priority=message.priority, timeout_ms=message.timeout_ms or None,
                )  # fmt: skip
                future = self._engine(message.model, version).batcher.enqueue(request, on_released=released)
        except VisionServeError as exc:
            self.endpoint.send(peer, Failed(message.id, self._wire(exc, message.model)))
            return
        key = (peer, message.id)
        self._pending[key] = future
        future.add_done_callback(lambda f: self._answer(key, message.model, f, released, version))

    def _submit_cold(self, peer: bytes, message: Submit, images: np.ndarray) -> None:
        """A request for an on-demand model that is not resident: it waits for the model's one load, then queues."""

        released = self._releaser(peer, message.id)

        async def cold() -> InferResult:
            started = time.monotonic()
            deadline = started + message.timeout_ms / 1000.0 if message.timeout_ms else None
            try:
                # Again if it went before this request got to it (an unload or reload by the repository API).
                while message.model not in self.models:
                    await self.residency.wait_for(message.model, deadline)
                    if self.draining:
                        raise OverloadedError("the server is shutting down")
                    if deadline is not None and time.monotonic() >= deadline:
                        raise DeadlineExceededError(f"the deadline passed while model {message.model!r} loaded")
            except asyncio.CancelledError:
                released("cancelled while loading")  # its images were never queued: nothing reads them
                raise
            waited = time.monotonic() - started
            left_ms = message.timeout_ms - waited * 1000.0 if message.timeout_ms else None
            request = InferRequest(
                request_id=message.request_id, model=message.model, version=message.version, images=images,
                priority=message.priority, timeout_ms=left_ms,
            )  # fmt: skip
            queued = self._engine(message.model, message.version).batcher.enqueue(request, on_released=released)
            try:
                result = await queued
            except asyncio.CancelledError:
                if queued.done() and not queued.cancelled():  # answered just as the cancel came
                    released.unanswered()
                raise
            result.cold_start_s = waited
            return result

        key = (peer, message.id)
        task = asyncio.get_running_loop().create_task(cold())
        self._pending[key] = task
        task.add_done_callback(lambda f: self._answer(key, message.model, f, released, message.version))

    def _releaser(self, peer: bytes, number: int) -> Release:
        """What a request cancelled (or failed while a batch read it) calls once its pixels are read no more: the
        front end frees them on this answer (it keeps them until the engine answers, since a batch may read them)."""
        return Release(lambda why: self.endpoint.send(peer, Failed(number, WireError.of(CancelledError(why)))))

    def _answer(
        self, key: tuple[bytes, int], model: str, future: asyncio.Future[InferResult], released: Release, version: int
    ) -> None:
        """Send the request's answer (``version``: the one that computed it, unless the result names another)."""
        self._pending.pop(key, None)
        peer, number = key
        if future.cancelled():
            return  # the front end asked for it and no longer waits; `released` answers once nothing reads it
        exc = future.exception()
        if exc is not None:
            released.answered = True  # held: a batch still reads the pixels, `released` frees them when done
            self.endpoint.send(peer, Failed(number, self._wire(exc, model), held=released.held))
            return
        result = future.result()
        errors = [None if e is None else WireError.of(e) for e in result.errors]
        logits = np.ascontiguousarray(result.logits, dtype=np.float32)
        stamps = Stamps(result.received, result.instance, result.batch, result.done)
        self.endpoint.send(peer, Result(number, logits.tobytes(), int(logits.shape[1]), errors if any(errors) else None,
                                        result.queue_s, result.compute_s, result.batch_sizes, stamps,
                                        result.cold_start_s, result.version or version))  # fmt: skip

    def _wire(self, exc: BaseException, model: str) -> WireError:
        wire = WireError.of(exc)
        entry = self.configs.get(model)
        if isinstance(exc, OverloadedError) and not isinstance(exc, MemoryBudgetError) and entry and not wire.status:
            wire = WireError(wire.kind, wire.message, entry.config.queue_full_status)
        return wire

    def cancel(self, peer: bytes, request: int) -> None:
        future = self._pending.get((peer, request))
        if future is not None:
            future.cancel()

    def _engine(self, name: str, version: int) -> ModelEngine:
        versions = self.models.get(name)
        if not versions:
            reason = self.errors.get(name) or self.unloaded.get(name)
            raise NotFoundError(f"unknown model {name!r}" + (f" ({reason})" if reason else ""))
        if version not in versions:
            raise NotFoundError(f"model {name!r} has no version {version} (versions: {sorted(versions)})")
        return versions[version]

    async def query(self, peer: bytes, message: Query) -> Any:
        handler = _QUERIES.get(message.what)
        if handler is None:
            raise BadInputError(f"unknown query {message.what!r}")
        return await handler(self, message.args)

    # ---- queries ----------------------------------------------------------------------------------------------
    async def _catalog(self, args: dict[str, Any]) -> Any:
        models = [
            ModelInfo(
                model=name,
                version=number,
                spec_json=encode_spec(engine.spec),
                config=msgspec.to_builtins(self.configs[name].config),
                state={**msgspec.to_builtins(engine.state()), **self.residency.describe(name)},
            )
            for name, versions in sorted(self.models.items())
            for number, engine in sorted(versions.items())
        ]
        models += self.residency.available()
        routes = {name: v for name in self.models if (v := self.rollouts.version_for(name, 0))}
        sticky = {name: r.config.sticky_header for name, r in self.rollouts.by_model.items()
                  if r.running and r.config.mode == "canary" and r.config.sticky_header}  # fmt: skip
        return Catalog(sorted(models, key=lambda m: (m.model, m.version)), dict(self.errors), dict(self.unloaded),
                       self._version, routes, sticky)  # fmt: skip

    async def _metrics(self, args: dict[str, Any]) -> Any:
        if self.metrics is None:
            raise NotFoundError("metrics are off (--no-metrics)")
        await self.endpoint.flush()
        # Rendered off the event loop: with 40 models the text is ~4 MB and took 0.3-1.2 s, during which this
        # engine answered nothing (a scrape every 0.5 s took another client's p99 from 26 to 200 ms). In a thread
        # the loop still runs between the renderer's GIL slices. The recorders fold under their own locks.
        return await asyncio.to_thread(self.metrics.render)

    async def _stats(self, args: dict[str, Any]) -> Any:
        await self.endpoint.flush()
        counts: dict[tuple[str, int], dict[str, int]] = {}
        for snapshot in list(self.endpoint.snapshots.values()):
            for c in snapshot.counts:
                into = counts.setdefault((c.model, c.version), {})
                for field in ModelCounts.__struct_fields__[2:]:
                    value = getattr(c, field)
                    into[field] = (
                        max(into.get(field, 0), value) if field == "last_inference_ms" else (into.get(field, 0) + value)
                    )
        rows = []
        for name, versions in sorted(self.models.items()):
            for number, engine in sorted(versions.items()):
                batcher = engine.batcher
                rows.append({
                    "model": name, "version": number, **counts.get((name, number), {}),
                    "batches": batcher.batches,
                    "batch_sizes": {str(k): [v, batcher.size_compute_ns.get(k, 0)]
                                    for k, v in sorted(batcher.size_counts.items())},
                })  # fmt: skip
        return rows

    async def _index(self, args: dict[str, Any]) -> Any:
        """Every model in the repository with its state, the ones not loaded too (Triton's repository index)."""
        try:
            names = await asyncio.to_thread(self.repository.model_names)
        except ConfigError as exc:
            names = []
            log.error("repository index: %s", exc)
        rows: list[dict[str, Any]] = []
        for name in sorted(set(names) | set(self.models) | set(self.errors)):
            base = name.partition("/")[0]
            if "/" in name:
                continue
            # Triton's rows for a pinned model; an on-demand model's say whether it is resident, and why not.
            residency = self.residency.describe(base) if base in self.residency.on_demand else {}
            if base in self.models:
                rows += [{"name": base, "version": str(v), "state": "READY", **residency}
                         for v in sorted(self.models[base])]  # fmt: skip
                continue
            if base in self.residency.on_demand:
                why = residency["why_not_resident"]
                rows += [{"name": base, "version": str(v), "state": "AVAILABLE", "reason": why, **residency}
                         for v in sorted(self.residency.on_demand[base].versions)]  # fmt: skip
                continue
            reason = self.unloaded.get(base) or self.errors.get(base) or _version_errors(self.errors, base)
            rows.append({"name": base, "state": "UNAVAILABLE", "reason": reason or "not loaded"})
        return rows

    async def _load_model(self, args: dict[str, Any]) -> Any:
        name = str(args.get("name", ""))
        async with self._lock:
            entry = await asyncio.to_thread(self.repository.model, name)
            override = args.get("config")
            if override is not None:
                entry = with_config(entry, override)
            await self.residency.settle(name)  # an on-demand load of it in progress goes first
            old = self.models.pop(name, None)
            charge = self.residency.accounts.release(name)
            if charge is not None:  # the old copy holds its memory until it is closed, below
                self.residency.accounts.leaving.append(charge)
            for key in [k for k in self.errors if k == name or k.startswith(f"{name}/")]:
                del self.errors[key]
            try:
                await self._load_charged(entry, "explicit")
                if old:
                    for engine in old.values():
                        await engine.close(self.settings.drain_timeout_s)
            finally:
                if charge is not None:
                    self.residency.accounts.leaving.remove(charge)
            if entry.config.residency == "on_demand":  # as its config now says (a config sent may change it)
                self.residency.offer(entry)
            else:
                self.residency.on_demand.pop(name, None)
            if name not in self.models:
                reasons = [e for key, e in self.errors.items() if key.startswith(f"{name}/")]
                raise ConfigError(f"model {name!r} failed to load: {'; '.join(reasons) or 'see the log'}")
        return {"name": name, "state": "READY"}

    async def _unload_model(self, args: dict[str, Any]) -> Any:
        name = str(args.get("name", ""))
        async with self._lock:
            if name in self.residency.on_demand:  # out of memory, still available: its next request loads it
                await self.residency.settle(name)  # a load of it in progress first, or it would stay resident
                await self.residency.evict(name, "unloaded by request", reason="unload")
                return {"name": name, "state": "AVAILABLE"}
            old = self.models.pop(name, None)
            if old is None:
                if name not in await asyncio.to_thread(self.repository.model_names):
                    raise NotFoundError(f"no model {name!r} in the repository")
                return {"name": name, "state": "UNAVAILABLE"}  # unloading an unloaded model is not an error
            self.residency.accounts.release(name)
            for key in [k for k in self.residency.accounts.charges if k.startswith(f"{name}@")]:
                self.residency.release_extra(key)
            self.rollouts.by_model.pop(name, None)
            self.residency.count_eviction(name, "unload")
            self.unloaded[name] = "unloaded by request"
            self._version += 1
            for engine in old.values():
                await engine.close(self.settings.drain_timeout_s)
        return {"name": name, "state": "UNAVAILABLE"}

    async def _rollout(self, args: dict[str, Any]) -> Any:
        return await self.rollouts.query(args, self._lock)

    # ---- metrics --------------------------------------------------------------------------------------------
    def _reported(self, field: str) -> list[Any]:
        """Every front end's latest report of ``field`` (requests, streams): the collectors merge them."""
        return [item for snap in list(self.endpoint.snapshots.values()) for item in getattr(snap, field)]

    def _live(self) -> Any:
        for name, versions in list(self.models.items()):  # read on a scrape's thread: copies, not live views
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
        for versions in list(self.models.values()):
            for engine in versions.values():
                await engine.close(max(0.1, deadline - time.monotonic()))


def _version_errors(errors: dict[str, str], name: str) -> str:
    return "; ".join(e for key, e in errors.items() if key.startswith(f"{name}/"))


_QUERIES = {
    "catalog": EngineServer._catalog,
    "metrics": EngineServer._metrics,
    "stats": EngineServer._stats,
    "index": EngineServer._index,
    "load": EngineServer._load_model,
    "unload": EngineServer._unload_model,
    "rollout": EngineServer._rollout,
}
