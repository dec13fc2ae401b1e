"""What a front-end process holds while it runs: its connection to the engine, the models the engine serves (read
from the engine's catalog), a decoding pool per model, and its own request records.

Handlers see one :class:`ServerState` and a :class:`ModelSlot` per served model version: ``decode`` (in this
process's pool), ``infer`` (the uint8 batch goes into this front end's shared-memory arena and the engine's batcher
computes it with every other front end's requests) and ``observe`` (one request record, however it ends). Ready
means: the engine is up and has said what it serves, and the server is not draining.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from service.core.config import ModelConfig
from service.core.decoding import Decoded, Preprocessor
from service.core.errors import (
    BadInputError,
    CancelledError,
    DeadlineExceededError,
    NotFoundError,
    OverloadedError,
    VisionServeError,
)
from service.core.metrics import NOT_OBSERVED, PROTOCOLS, STAGES, Metrics, ModelCounts
from service.core.preprocess import ImageLimits
from service.core.settings import ServerSettings
from service.core.spec import ModelSpec, decode_spec
from service.core.status import EngineState, InferResult
from service.transport.client import UNAVAILABLE, EngineClient
from service.transport.messages import Catalog, ModelInfo, Snapshot, Stamps
from service.transport.shm import Arena

log = logging.getLogger("visionserve.server")


@dataclass
class Timing:
    """Where one request's time went (Server-Timing, the access log and the stage histograms).

    The durations (``preprocess_s``, ``queue_s``, ``compute_s``, ``postprocess_s``) are what the first metrics
    reported. The stamps are ``time.perf_counter()`` seconds, which on Linux is CLOCK_MONOTONIC, the clock the engine
    stamps with too (``time.monotonic()``): one clock for the whole machine, so stamps taken in the engine process
    line up with the front end's. :meth:`stages` turns them into :data:`STAGES`, contiguous, summing to the total.
    """

    preprocess_s: float = 0.0
    queue_s: float = 0.0
    compute_s: float = 0.0
    postprocess_s: float = 0.0
    arrived: float = field(default_factory=time.perf_counter)  # the request's first byte seen by the server
    read: float = NOT_OBSERVED  # its body read
    decode_start: float = NOT_OBSERVED  # the first decode thread took an image
    decode_end: float = NOT_OBSERVED  # the last image decoded
    sent: float = NOT_OBSERVED  # the message to the engine sent (the pixels in shared memory)
    engine: Stamps | None = None  # the engine's stamps of the answer (the last batch, for a split request)
    answered: float = NOT_OBSERVED  # the answer read off the transport by this front end

    def mark_read(self) -> None:
        if math.isnan(self.read):
            self.read = time.perf_counter()

    def stages(self, end: float) -> tuple[float, ...] | None:
        """The :data:`STAGES` durations (seconds) of a request answered by the engine, ending at ``end``; None for
        one that never got an answer. Each stage runs from the previous one's end, so they sum to ``end -
        arrived``; a stamp a request has no use for (no decoding for a tensor body) makes its stage zero."""
        e = self.engine
        if e is None or math.isnan(self.answered) or math.isnan(self.sent):
            return None
        read = self.read if not math.isnan(self.read) else self.arrived
        decode_start = self.decode_start if not math.isnan(self.decode_start) else read
        decode_end = self.decode_end if not math.isnan(self.decode_end) else decode_start
        # Clamped in order: a stamp that precedes the one before it (threads racing the loop by microseconds)
        # gives a zero stage rather than a negative one, and the sum still ends where it should.
        points = [self.arrived, read, decode_start, decode_end, self.sent, e.received,
                  max(e.instance, e.received), e.batch, e.done, self.answered, end]  # fmt: skip
        out: list[float] = []
        last = points[0]
        for point in points[1:]:
            point = max(point, last)
            out.append(point - last)
            last = point
        return tuple(out)

    def header(self, total_s: float | None = None) -> str:
        stages = self.stages(self.arrived + total_s) if total_s is not None else None
        parts = [f"queue;dur={self.queue_s * 1000:.3f}", f"preprocess;dur={self.preprocess_s * 1000:.3f}"]
        if stages is None:
            parts.append(f"compute;dur={self.compute_s * 1000:.3f}")
        parts.append(f"postprocess;dur={self.postprocess_s * 1000:.3f}")
        if stages is not None:  # every stage by name (its "compute" in place of the batcher's own, nearly equal)
            parts += [f"{name};dur={s * 1000:.3f}" for name, s in zip(STAGES, stages, strict=True)]
        if total_s is not None:
            parts.append(f"total;dur={total_s * 1000:.3f}")
        return ", ".join(parts)


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


class VersionRef(msgspec.Struct, frozen=True):
    model: str
    version: int


class EngineView:
    """The engine's report on one model version, as last read from its catalog."""

    def __init__(self, info: ModelInfo) -> None:
        self._state = msgspec.convert(info.state, EngineState)

    @property
    def backend(self) -> str:
        return self._state.backend

    def state(self) -> EngineState:
        return self._state


class ModelSlot:
    """One served model version, seen from a front end."""

    def __init__(self, server: ServerState, info: ModelInfo, spec: ModelSpec, pool: Preprocessor) -> None:
        self._server = server
        self.version = VersionRef(info.model, info.version)
        self.spec = spec
        self.config = msgspec.convert(info.config, ModelConfig)
        self.engine = EngineView(info)
        self.pool = pool
        self.stats = server.stats_of(info.model, info.version)  # shared by every slot of that version
        labels = (info.model, str(info.version), ",".join(self.engine.state().devices))
        metrics = server.metrics
        self._recorders = {p: metrics.request_recorder(*labels, p) for p in PROTOCOLS} if metrics else None
        self._guard_s = server.settings.engine_timeout_s

    @property
    def name(self) -> str:
        return self.version.model

    @contextlib.contextmanager
    def observe(self, timing: Timing, protocol: str = "http") -> Iterator[None]:
        """Record one request's outcome and stage durations, once, however it ends; ``protocol``: http or grpc."""
        recorder = self._recorders[protocol] if self._recorders is not None else None
        outcome = "success"
        server = self._server
        server.requests_inflight += 1
        try:
            yield
        except BaseException as exc:
            outcome = outcome_of(exc)
            raise
        finally:
            server.requests_inflight -= 1
            if server.requests_inflight == 0 and server.draining and server.idle is not None:
                server.idle.set()
            if recorder is not None:
                done = outcome == "success"
                end = time.perf_counter()
                stages = timing.stages(end) if done else None
                recorder.record(
                    outcome,
                    end - timing.arrived,  # from the request's arrival, as the stages count
                    timing.preprocess_s or NOT_OBSERVED,
                    timing.queue_s if done else NOT_OBSERVED,
                    timing.postprocess_s if done else NOT_OBSERVED,
                    *(() if stages is None else (stages,)),
                )

    def record_refused(self, request_s: float, protocol: str = "http") -> None:
        """A request refused before its handler ran (a query parameter out of range): a ``bad_input`` outcome that
        reached no stage."""
        if self._recorders is not None:
            self._recorders[protocol].record("bad_input", request_s, NOT_OBSERVED, NOT_OBSERVED, NOT_OBSERVED)

    async def decode(self, images: list[bytes], timing: Timing) -> list[Decoded]:
        """Decode each image in the pool; a refused image becomes its own error."""
        started = time.perf_counter()
        timing.mark_read()
        submitted = [self.pool.submit(data) for data in images]
        futures = [asyncio.wrap_future(f) for f in submitted]
        results: list[Decoded] = []
        for future in futures:
            try:
                results.append(await future)
            except VisionServeError as exc:
                results.append(exc)
        timing.preprocess_s += time.perf_counter() - started
        if submitted:
            timing.decode_start = min(f.started for f in submitted)
            timing.decode_end = max(f.finished for f in submitted)
        return results

    async def infer(
        self,
        images: np.ndarray | list[np.ndarray],
        timing: Timing,
        *,
        priority: int = 0,
        timeout_ms: float | None = None,
    ) -> InferResult:
        """Compute a uint8 batch [N, C, H, W] (or a list of [C, H, W] images, stacked straight into shared memory)
        in the engine's batcher; the model's queue_full_status rides on an overload error."""
        try:
            result = await self._infer(images, timing, priority, timeout_ms)
        except VisionServeError:
            self.stats.failure += 1
            raise
        stats = self.stats
        stats.success += 1
        stats.images += len(result.logits)
        stats.queue_ns += int(result.queue_s * 1e9)
        stats.compute_ns += int(result.compute_s * 1e9)
        stats.preprocess_ns += int(timing.preprocess_s * 1e9)
        stats.last_inference_ms = int(time.time() * 1000)
        return result

    async def _infer(
        self, images: np.ndarray | list[np.ndarray], timing: Timing, priority: int, timeout_ms: float | None
    ) -> InferResult:
        server = self._server
        client = server.client_for(self.name)
        n = len(images)
        spec = self.spec.input
        shape = (n, spec.channels, spec.height, spec.width)
        offset, view = server.arena.allocate(shape)
        try:
            if isinstance(images, np.ndarray):
                np.copyto(view, images, casting="no")
            else:
                np.stack(images, out=view)
        except BaseException:
            server.arena.free(offset)
            raise
        del view
        timing.mark_read()  # a tensor body: read and parsed by now
        timing.sent = time.perf_counter()
        answer, timing.answered = await client.submit(
            self.name, self.version.version, offset, shape, timeout_ms=timeout_ms, priority=priority,
            request_id=uuid.uuid4().hex, guard_s=self._guard_s if not timeout_ms else timeout_ms / 1000.0 + 1.0,
        )  # fmt: skip
        logits = np.frombuffer(answer.logits, dtype=np.float32).reshape(n, answer.classes)
        errors: list[VisionServeError | None] = (
            [None if e is None else e.exception() for e in answer.errors] if answer.errors else [None] * n
        )
        timing.queue_s += answer.queue_s
        timing.compute_s += answer.compute_s
        timing.engine = answer.stamps
        return InferResult(logits, errors, answer.queue_s, answer.compute_s, list(answer.batch_sizes))


class ServerState:
    """The front end's view of the server: the engine's catalog, readiness, and this process's records."""

    def __init__(
        self, settings: ServerSettings, *, frontend: str = "fe0", arena: str = "", engines: tuple[str, ...] = ()
    ) -> None:
        self.settings = settings
        self.slots: dict[str, dict[int, ModelSlot]] = {}
        self.errors: dict[str, str] = {}
        self.draining = False
        self.started_at = time.time()
        self.limits = ImageLimits(max_pixels=settings.max_pixels)
        self.metrics = Metrics() if settings.metrics else None
        self.frontend = frontend
        self._arena_name = arena
        self._endpoints = engines
        self._pools: dict[tuple[str, int], Preprocessor] = {}
        self._stats: dict[tuple[str, int], ModelCounts] = {}
        self.clients: list[EngineClient] = []
        self._ready_event: asyncio.Event | None = None
        self.requests_inflight = 0  # inference requests past ``slot()`` and not yet answered
        self.idle: asyncio.Event | None = None  # set when draining and nothing is in flight

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new inference (503) and wait until every request already accepted has been answered, or
        ``timeout_s`` has passed; True when nothing is left in flight. The front end keeps accepting
        connections meanwhile, so that a request that arrives during the drain gets its 503 at once."""
        self.draining = True
        if self.requests_inflight == 0:
            return True
        self.idle = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.idle.wait(), timeout_s)
        return self.requests_inflight == 0

    # ---- lifecycle --------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Connect to the engines; readiness follows their catalogs (this does not wait for them)."""
        if not self._arena_name or not self._endpoints:
            raise RuntimeError("a front end needs an arena and an engine endpoint (start it with `visionserve serve`)")
        self.arena = Arena(self._arena_name)
        self._ready_event = asyncio.Event()
        for endpoint in self._endpoints:
            client = EngineClient(endpoint, self.arena, self.frontend, snapshot=self.snapshot, on_change=self._rebuild)
            await client.start()
            self.clients.append(client)

    async def wait_ready(self, timeout_s: float) -> bool:
        assert self._ready_event is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ready_event.wait(), timeout_s)
        return self.ready

    @property
    def ready(self) -> bool:
        return bool(self.clients) and all(c.up for c in self.clients)

    async def close(self) -> None:
        self.draining = True
        for client in self.clients:
            await client.close()
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        if self.clients:
            self.arena.close()

    # ---- the catalog --------------------------------------------------------------------------------------------
    def _rebuild(self) -> None:
        """Re-read what the engines serve (on connect, and whenever a model's state changes)."""
        slots: dict[str, dict[int, ModelSlot]] = {}
        errors: dict[str, str] = {}
        for client in self.clients:
            catalog: Catalog | None = client.catalog
            if catalog is None:
                continue
            errors.update(catalog.errors)
            errors.update(catalog.unloaded)
            for info in catalog.models:
                key = (info.model, info.version)
                spec = decode_spec(info.spec_json, source=f"{info.model} v{info.version}")
                pool = self._pools.get(key)
                if pool is None or pool.spec != spec:
                    pool = self._pools[key] = Preprocessor(
                        spec, self.limits, workers=self.settings.decode_workers,
                        large_pixels=self.settings.large_image_pixels,
                    )  # fmt: skip
                old = self.slots.get(info.model, {}).get(info.version)
                slot = ModelSlot(self, info, spec, pool) if old is None or _changed(old, info) else old
                slots.setdefault(info.model, {})[info.version] = slot
        self.slots = slots
        self.errors = errors
        if self.ready and self._ready_event is not None:
            self._ready_event.set()

    def client_for(self, model: str) -> EngineClient:
        """The engine to send ``model``'s request to: the least busy (from here) of those serving it and up."""
        best: EngineClient | None = None
        for client in self.clients:
            serves = client.up and client.catalog is not None and any(m.model == model for m in client.catalog.models)
            if serves and (best is None or client.inflight < best.inflight):
                best = client
        if best is None:
            raise OverloadedError(UNAVAILABLE)
        return best

    def stats_of(self, model: str, version: int) -> ModelCounts:
        counts = self._stats.get((model, version))
        if counts is None:
            counts = self._stats[(model, version)] = ModelCounts(model, version)
        return counts

    def slot(self, name: str, version: int | str | None = None) -> ModelSlot:
        """The model version a request is for. Called as a request arrives: once draining, new work is refused
        here with 503, while requests already past this point are still computed and answered."""
        if self.draining:
            raise OverloadedError("the server is shutting down")
        versions = self.slots.get(name)
        if not versions:
            if not self.ready and not self.slots:
                raise OverloadedError(UNAVAILABLE)
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

    # ---- what the engine gathers ------------------------------------------------------------------------------
    def snapshot(self, token: int) -> Snapshot:
        """Everything this front end has recorded (cumulative): the engine sums every front end's."""
        requests = self.metrics.request_snapshot() if self.metrics is not None else []
        counts = list(self._stats.values())  # encoded at once by the caller, before they count on
        return Snapshot(token, requests, counts)

    async def query_all(self, what: str, **args: Any) -> list[Any]:
        """Ask every engine; an engine that is down answers 503."""
        if not self.clients or not all(c.up for c in self.clients):
            raise OverloadedError(UNAVAILABLE)
        return list(await asyncio.gather(*(c.query(what, **args) for c in self.clients)))

    async def render_metrics(self) -> bytes:
        texts = await self.query_all("metrics")
        return bytes(texts[0]) if len(texts) == 1 else _merge_exposition(texts)

    async def model_stats(self) -> dict[tuple[str, int], dict[str, Any]]:
        """The whole server's statistics per model version: every front end's counts, every engine's batches."""
        merged: dict[tuple[str, int], dict[str, Any]] = {}
        for rows in await self.query_all("stats"):
            for row in rows:
                key = (row["model"], int(row["version"]))
                into = merged.setdefault(key, {"batches": 0, "batch_sizes": {}})
                for name, value in row.items():
                    if name == "batch_sizes":
                        for size, (count, ns) in value.items():
                            seen = into["batch_sizes"].get(int(size), (0, 0))
                            into["batch_sizes"][int(size)] = (seen[0] + count, seen[1] + ns)
                    elif name == "batches":
                        into["batches"] += value
                    elif name not in ("model", "version"):
                        into[name] = value  # front-end counts: the first engine gathers them all
        return merged

    async def repository_index(self) -> list[dict[str, Any]]:
        rows: dict[tuple[str, str], dict[str, Any]] = {}
        for engine_rows in await self.query_all("index"):
            for row in engine_rows:
                rows.setdefault((row["name"], row.get("version", "")), row)
        return [rows[key] for key in sorted(rows)]

    async def load_model(self, name: str, config: Any = None) -> None:
        """Load (or reload) ``name`` on every engine; this front end sees the change before answering, the others
        within an engine heartbeat (0.5 s)."""
        await self.query_all("load", name=name, config=config)
        await asyncio.gather(*(client.refresh() for client in self.clients))

    async def unload_model(self, name: str) -> None:
        await self.query_all("unload", name=name)
        await asyncio.gather(*(client.refresh() for client in self.clients))


def _changed(slot: ModelSlot, info: ModelInfo) -> bool:
    return slot.engine.state() != msgspec.convert(info.state, EngineState) or slot.config != msgspec.convert(
        info.config, ModelConfig
    )


def _merge_exposition(texts: list[Any]) -> bytes:
    """Several engines' Prometheus texts as one (families merged by name; samples never overlap: each engine
    labels its own devices, and only the first renders the front ends' request families)."""
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Any] = {}
    for text in texts:
        for family in text_string_to_metric_families(bytes(text).decode()):
            seen = families.get(family.name)
            if seen is None:
                families[family.name] = family
            else:
                seen.samples.extend(family.samples)
    lines: list[str] = []
    for family in families.values():
        lines.append(f"# HELP {family.name} {family.documentation}")
        lines.append(f"# TYPE {family.name} {family.type}")
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items())
            lines.append(f"{sample.name}{{{labels}}} {sample.value!r}" if labels else f"{sample.name} {sample.value!r}")
    return ("\n".join(lines) + "\n").encode()
