"""What a front end holds while it runs: its links to the engines (``service.frontend.link``), the models they serve
(read from their catalogs), a decoding pool per model, and its own request records. Handlers see one
:class:`ServerState` and a :class:`ModelSlot` per served model version (``decode`` in this process's pool,
``infer`` over the link, ``observe`` one request record however it ends).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import msgspec
import numpy as np

from service.core.boxes import Transform
from service.core.config import ModelConfig
from service.core.decoding import Decoded, Preprocessor
from service.core.errors import BadInputError, NotFoundError, OverloadedError, VisionServeError, outcome_label
from service.core.metrics import NOT_OBSERVED, PROTOCOLS, Metrics, ModelCounts
from service.core.preprocess import ImageLimits
from service.core.settings import ServerSettings
from service.core.spec import ModelSpec, decode_spec
from service.core.status import EngineState, InferResult
from service.core.stream_metrics import FrameCounts, StreamState
from service.core.tasks import Task, task_for
from service.frontend.link import EngineLink, Linker
from service.frontend.timing import Timing
from service.transport.client import UNAVAILABLE
from service.transport.messages import Catalog, ModelInfo, Snapshot

__all__ = ["ModelSlot", "ServerState", "VersionRef"]

log = logging.getLogger("visionserve.server")


class VersionRef(msgspec.Struct, frozen=True):
    model: str
    version: int


class ModelSlot:
    """One served model version, seen from a front end."""

    def __init__(self, server: ServerState, info: ModelInfo, spec: ModelSpec, pool: Preprocessor) -> None:
        self._server = server
        self.version = VersionRef(info.model, info.version)
        self.spec = spec
        self.task: Task = task_for(spec)  # what its outputs mean: built once, not per request
        self.config = msgspec.convert(info.config, ModelConfig)
        self.engine = msgspec.convert(info.state, EngineState)  # its engine's report, as last read from the catalog
        self.pool = pool
        key = (info.model, info.version)
        self.stats = server.counts.setdefault(key, ModelCounts(*key))  # shared by every slot of that version
        labels = (info.model, str(info.version), ",".join(self.engine.devices))
        metrics = server.metrics
        self._recorders = {p: metrics.request_recorder(*labels, p) for p in PROTOCOLS} if metrics else None
        self._guard_s = server.settings.engine_timeout_s

    @property
    def name(self) -> str:
        return self.version.model

    def answered_by(self, version: int) -> ModelSlot:
        """The slot of the version that answered (``version``, 0: this one): a rollout's canary answers for its
        primary, and its requests are counted on its own version."""
        if not version or version == self.version.version:
            return self
        return self._server.slots.get(self.name, {}).get(version, self)

    @contextlib.contextmanager
    def observe(self, timing: Timing, protocol: str = "http") -> Iterator[None]:
        """Record one request's outcome and stage durations, once, however it ends, on the version that answered;
        ``protocol``: http or grpc."""
        outcome = "success"
        server = self._server
        server.requests_inflight += 1
        try:
            yield
        except BaseException as exc:
            outcome = outcome_label(exc)
            raise
        finally:
            server.requests_inflight -= 1
            if server.requests_inflight == 0 and server.draining and server.idle is not None:
                server.idle.set()
            recorders = self.answered_by(timing.version)._recorders
            if recorders is not None:
                recorder = recorders[protocol]
                done = outcome == "success"
                end = time.perf_counter()
                stages = timing.stages(end) if done else None
                if done and timing.detections:
                    recorder.record_detections(timing.detections)
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

    async def decode(self, images: list[bytes], timing: Timing) -> tuple[list[Decoded], list[Transform | None]]:
        """Decode each image in the pool; a refused image becomes its own error. Beside them, each image's transform
        to the input (None for a refused one): where a detector's boxes map back to."""
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
        return results, [f.transform for f in submitted]

    async def infer(
        self,
        images: np.ndarray | list[np.ndarray],
        timing: Timing,
        *,
        priority: int = 0,
        timeout_ms: float | None = None,
        route: str | None = None,
    ) -> InferResult:
        """Compute a uint8 batch [N, C, H, W] (or a list of [C, H, W] images, stacked straight into shared memory)
        in the engine's batcher; the model's queue_full_status rides on an overload error. ``route``: None when the
        request named its version, else the engine picks the version (:meth:`ServerState.route`)."""
        n = len(images)
        timing.mark_read()  # a tensor body: read and parsed by now
        try:
            answer = await self._server.link_for(self.name).submit(
                self.name, self.version.version, images, timeout_ms=timeout_ms, priority=priority,
                request_id=uuid.uuid4().hex, guard_s=self._guard_s if not timeout_ms else timeout_ms / 1000.0 + 1.0,
                route=route,
            )  # fmt: skip
        except VisionServeError:
            self.stats.failure += 1
            raise
        result = answer.result
        timing.sent, timing.answered = answer.sent, answer.answered
        outputs = {tensor.name: tensor.array(n) for tensor in result.outputs}  # over the message's bytes
        errors: list[VisionServeError | None] = (
            [None if e is None else e.exception() for e in result.errors] if result.errors else [None] * n
        )
        timing.queue_s += result.queue_s
        timing.compute_s += result.compute_s
        timing.cold_start_s += result.cold_start_s
        timing.engine = result.stamps
        timing.version = result.version
        stats = self.answered_by(result.version).stats
        stats.success += 1
        stats.images += len(errors)
        stats.queue_ns += int(result.queue_s * 1e9)
        stats.compute_ns += int(result.compute_s * 1e9)
        stats.preprocess_ns += int(timing.preprocess_s * 1e9)
        stats.last_inference_ms = int(time.time() * 1000)
        return InferResult(
            outputs, errors, result.queue_s, result.compute_s, list(result.batch_sizes), version=result.version
        )


class ServerState:
    """The front end's view of the server: the engines' catalogs, readiness, and this process's records. ``linker``
    gives the links to the engines; ``frontends``: how many front ends the server runs, all of which every engine
    must have heard from before it is ready (they share one listening socket)."""

    def __init__(
        self, settings: ServerSettings, linker: Linker | None, *, frontend: str = "fe0", frontends: int = 1
    ) -> None:
        self.settings = settings
        self.slots: dict[str, dict[int, ModelSlot]] = {}
        self.errors: dict[str, str] = {}  # model (or "model/version") -> why it is not served
        self.load_errors: dict[str, str] = {}  # the part of ``errors`` that failed to load (not unloaded on purpose)
        self.draining = False
        self.started_at = time.time()
        self.limits = ImageLimits(max_pixels=settings.max_pixels)
        self.metrics = Metrics() if settings.metrics else None
        self.frontend = frontend
        self.frontends = frontends
        self._linker = linker
        self._pools: dict[tuple[str, int], Preprocessor] = {}
        self.counts: dict[tuple[str, int], ModelCounts] = {}  # per model version: this front end's
        self.links: list[EngineLink] = []
        self.routes: dict[str, int] = {}  # model -> the version serving requests that name none (a rollout's)
        self.sticky_headers: dict[str, str] = {}  # model -> the header a sticky canary routes by
        self._ready_event: asyncio.Event | None = None
        self.requests_inflight = 0  # inference requests past ``slot()`` and not yet answered
        self.streams: set[Any] = set()  # open streams (each has ``drain()``): told to end when the server drains
        self.stream_counts: dict[str, FrameCounts] = {}  # model -> its streams' frames and how many are open
        self.idle: asyncio.Event | None = None  # set when draining and nothing is in flight
        self.sources: Any = None  # the sources this front end runs (service.frontend.sources.registry.Sources)
        self.sources_owner: Any = None  # or the front end that runs them (service.frontend.sources.forward.Owner)

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new inference (503) and wait until every request already accepted has been answered, or
        ``timeout_s`` has passed; True when nothing is left in flight. The front end keeps accepting
        connections meanwhile, so that a request that arrives during the drain gets its 503 at once."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        streams = list(self.streams)
        for stream in streams:  # each answers the frames it holds, then closes
            stream.drain()
        if self.requests_inflight > 0:
            self.idle = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.idle.wait(), timeout_s)
        if streams:
            ends = [asyncio.ensure_future(s.done.wait()) for s in streams]
            _, pending = await asyncio.wait(ends, timeout=max(0.0, deadline - time.monotonic()))
            for end in pending:
                end.cancel()
        return self.requests_inflight == 0

    # ---- lifecycle --------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Connect to the engines; readiness follows their catalogs (this does not wait for them)."""
        if self._linker is None:
            raise RuntimeError("a front end needs a link to an engine (start it with `visionserve serve`)")
        self._ready_event = asyncio.Event()
        self.links = self._linker.connect(self)
        for link in self.links:
            await link.start()

    async def wait_linked(self, poll_s: float = 0.1) -> bool:
        """Until every engine link is up and has said what it serves (True), or the server drains first (False).
        A front end accepts connections only after this, so none is ever answered by one that cannot serve."""
        assert self._ready_event is not None
        while not self.draining:
            if self.linked:
                return True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ready_event.wait(), poll_s)
        return False

    @property
    def linked(self) -> bool:
        """Every engine link is up: this front end can serve."""
        return bool(self.links) and all(link.up for link in self.links)

    @property
    def ready(self) -> bool:
        """This front end can serve, and every engine has heard from every front end: the whole server can. With
        ``strict_readiness``, also: no model version failed to load."""
        if self.settings.strict_readiness and self.load_errors:
            return False
        return self.linked and all(link.frontends >= self.frontends for link in self.links)

    async def close(self) -> None:
        self.draining = True
        for link in self.links:
            await link.close()
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        if self._linker is not None:
            self._linker.close()

    # ---- the catalog --------------------------------------------------------------------------------------------
    def catalog_changed(self) -> None:
        """Re-read what the engines serve (on connect, and whenever a model's state or readiness changes)."""
        slots: dict[str, dict[int, ModelSlot]] = {}
        errors: dict[str, str] = {}
        load_errors: dict[str, str] = {}
        routes: dict[str, int] = {}
        sticky: dict[str, str] = {}
        for link in self.links:
            catalog: Catalog | None = link.catalog
            if catalog is None:
                continue
            routes.update(catalog.routes)
            sticky.update(catalog.sticky_headers)
            load_errors.update(catalog.errors)
            errors.update(catalog.errors | catalog.unloaded)
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
        self.slots, self.routes, self.sticky_headers = slots, routes, sticky
        self.errors, self.load_errors = errors, load_errors
        if self.linked and self._ready_event is not None:
            self._ready_event.set()

    def link_for(self, model: str) -> EngineLink:
        """The engine to send ``model``'s request to: the least busy (from here) of those serving it and up."""
        serving = [e for e in self.links if e.up and e.catalog and any(m.model == model for m in e.catalog.models)]
        if not serving:
            raise OverloadedError(UNAVAILABLE)
        return min(serving, key=lambda link: link.inflight)

    def slot(self, name: str, version: int | str | None = None) -> ModelSlot:
        """The model version a request is for. Called as a request arrives: once draining, new work is refused
        here with 503, while requests already past this point are still computed and answered."""
        if self.draining:
            raise OverloadedError("the server is shutting down")
        versions = self.slots.get(name)
        if not versions:
            if not self.linked and not self.slots:
                raise OverloadedError(UNAVAILABLE)
            reason = self.errors.get(name) or "; ".join(
                f"version {key.partition('/')[2]}: {why}"
                for key, why in self.errors.items()
                if key.startswith(name + "/")
            )
            raise NotFoundError(f"unknown model {name!r}" + (f" (refused at load: {reason})" if reason else ""))
        if version in (None, ""):
            serving = versions.get(self.routes.get(name, 0))
            return serving if serving is not None else versions[max(versions)]
        try:
            number = int(version)
        except (TypeError, ValueError):
            raise BadInputError(f"model version must be a positive integer, got {version!r}") from None
        if number not in versions:
            raise NotFoundError(f"model {name!r} has no version {number} (versions: {sorted(versions)})")
        return versions[number]

    @contextlib.contextmanager
    def stream_open(self, model: str, stream: Any) -> Iterator[None]:
        """``stream`` (with ``drain()`` and ``done``, an event set once it has closed: a stream session, a source) is
        open on ``model`` for the block: told to end when the server drains, and counted in
        ``visionserve_streams_open``. The one registration of streams and sources alike."""
        counts = self.stream_counts.setdefault(model, FrameCounts())  # ``open`` kept at 0 once closed: a gauge
        self.streams.add(stream)
        counts.open += 1
        try:
            yield
        finally:
            self.streams.discard(stream)
            counts.open -= 1

    def stream_outcome(self, model: str) -> Callable[[str, float], None]:
        """The hook a stream of ``model`` calls with each frame's outcome (answered, superseded, expired, error) and
        age in seconds: counted here, reported to the engine with the other counts."""
        return self.stream_counts.setdefault(model, FrameCounts()).add

    def route(self, name: str, version: int | str | None, headers: Mapping[str, str]) -> str | None:
        """What a request's Submit says of its version: None when it named one; else the value of the header a
        sticky canary of ``name`` routes by ("" without one), and the engine picks the version."""
        if version not in (None, "", 0):
            return None
        header = self.sticky_headers.get(name)
        return (headers.get(header) or "") if header else ""

    # ---- what the engine gathers ------------------------------------------------------------------------------
    def snapshot(self, token: int) -> Snapshot:
        """Everything this front end has recorded (cumulative): the engine sums every front end's."""
        requests = self.metrics.request_snapshot() if self.metrics is not None else []
        counts = list(self.counts.values())  # encoded at once by the caller, before they count on
        sources = self.sources.states() if self.sources is not None else []
        # Copies: the in-process engine reads them on a scrape's thread while streams count on.
        streams = [
            StreamState(m, c.outcomes(), list(c.ages), c.open) for m, c in sorted(dict(self.stream_counts).items())
        ]
        return Snapshot(token, requests, counts, streams, sources)

    async def each_engine(self, call: Callable[[EngineLink], Any]) -> list[Any]:
        """Ask every engine (``call``: one of a link's control calls on it); an engine that is down answers 503."""
        if not self.linked:
            raise OverloadedError(UNAVAILABLE)
        return list(await asyncio.gather(*(call(link) for link in self.links)))

    async def render_metrics(self) -> bytes:
        texts = await self.each_engine(lambda link: link.metrics())
        return bytes(texts[0]) if len(texts) == 1 else merge_exposition(texts)

    async def model_stats(self) -> dict[tuple[str, int], dict[str, Any]]:
        """The whole server's statistics per model version: every front end's counts, every engine's batches."""
        merged: dict[tuple[str, int], dict[str, Any]] = {}
        for rows in await self.each_engine(lambda link: link.stats()):
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
        for engine_rows in await self.each_engine(lambda link: link.index()):
            for row in engine_rows:
                rows.setdefault((row["name"], row.get("version", "")), row)
        return [rows[key] for key in sorted(rows)]

    async def load_model(self, name: str, config: Any = None) -> None:
        """Load (or reload) ``name`` on every engine; this front end sees the change before answering, the others
        within an engine heartbeat (0.5 s)."""
        await self.each_engine(lambda link: link.load(name, config))
        await asyncio.gather(*(link.refresh() for link in self.links))

    async def unload_model(self, name: str) -> None:
        await self.each_engine(lambda link: link.unload(name))
        await asyncio.gather(*(link.refresh() for link in self.links))


def _changed(slot: ModelSlot, info: ModelInfo) -> bool:
    return slot.engine != msgspec.convert(info.state, EngineState) or slot.config != msgspec.convert(
        info.config, ModelConfig
    )


def merge_exposition(texts: list[Any]) -> bytes:
    """Several engines' Prometheus texts as one (families merged by name; samples never overlap: each engine
    labels its own devices, and only the first renders the front ends' request families)."""
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Any] = {}
    for text in texts:
        for family in text_string_to_metric_families(bytes(text).decode()):
            seen = families.setdefault(family.name, family)
            if seen is not family:
                seen.samples.extend(family.samples)
    lines: list[str] = []
    for family in families.values():
        lines += [f"# HELP {family.name} {family.documentation}", f"# TYPE {family.name} {family.type}"]
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items())
            lines.append(f"{sample.name}{{{labels}}} {sample.value!r}" if labels else f"{sample.name} {sample.value!r}")
    return ("\n".join(lines) + "\n").encode()
