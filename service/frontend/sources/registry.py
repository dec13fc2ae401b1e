"""The server's sources (docs/sources.md): created, changed and deleted while the server runs, or started with it
from ``--sources FILE``; at most ``--max-sources`` running at once. A running source is an open stream of its model
(``ServerState.stream_open``); a finished one stays listed until deleted, the oldest forgotten past
:data:`FINISHED_KEPT`; each is kept in the store (:mod:`service.frontend.sources.store`) until it is deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.util
import json
import logging
import re
import secrets
import sqlite3
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from service.core.errors import BadInputError, ConfigError, NotFoundError, OverloadedError, VisionServeError, shown
from service.core.parameters import MAX_INT
from service.core.source_metrics import SourceState
from service.core.tasks import TASKS, fields
from service.core.tracking import read_track
from service.frontend import request as path
from service.frontend.sources.source import Source, SourceOptions
from service.frontend.sources.store import SourceStore
from service.frontend.sources.urls import check_url
from service.frontend.state import ModelSlot, ServerState
from service.frontend.stream import stream_max_age, stream_want

log = logging.getLogger("visionserve.sources")

FINISHED_KEPT = 64
MAX_FPS_LIMIT = 240.0
_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
TRACK_KEYS = ("track", "lines", "zones", "normalized")  # docs/tracking.md
COMMON_KEYS = ("url", "model", "version", "id", "max_fps", "max_age_ms", "pace", "rtsp_transport", *TRACK_KEYS)


def task_keys() -> tuple[str, ...]:
    """Every task's options: a source takes those of its model's task, beside :data:`COMMON_KEYS`."""
    return tuple(dict.fromkeys(f.name for task in TASKS.values() for f in fields(task.Options)))


def changeable() -> tuple[str, ...]:
    """What a PATCH may change."""
    return ("max_fps", "max_age_ms", "pace", *TRACK_KEYS, *task_keys())


class Sources:
    """Every source of this server, by id."""

    def __init__(self, server: ServerState, store: SourceStore | None = None) -> None:
        self.server = server
        self.settings = server.settings
        self.store = store  # None: nothing is kept across restarts (the store could not be opened: logged)
        self.sources: dict[str, Source] = {}
        self._telling: set[asyncio.Task[None]] = set()
        self._open: dict[Source, contextlib.ExitStack] = {}  # each running source's registration, until it finishes
        # Sources deleted or forgotten whose reader thread has not ended yet (stuck in a DNS lookup or a connect
        # FFmpeg cannot interrupt): each still holds a thread, so each counts against --max-sources until it ends.
        self._lingering: set[Source] = set()

    # ---- the routes' calls --------------------------------------------------------------------------------------
    def create(self, body: Any, *, keep: bool = True) -> Source:
        """Check ``body`` and start its source, its row stored first (``keep``: false for a row started again from
        the store); BadInputError (400) naming what is wrong, NotFoundError for an unknown model, OverloadedError
        (503) at ``--max-sources`` running or when the store cannot be written."""
        if self.server.draining:
            raise OverloadedError("the server is draining: no new sources")
        if not isinstance(body, Mapping):
            raise BadInputError("a source is a JSON object with at least 'url' and 'model'")
        unknown = sorted(set(body) - {*COMMON_KEYS, *task_keys()})
        if unknown:
            raise BadInputError(f"unknown source field(s) {', '.join(map(repr, unknown))}; known: "
                                f"{', '.join((*COMMON_KEYS, *task_keys()))}")  # fmt: skip
        if importlib.util.find_spec("av") is None:
            raise BadInputError("sources need PyAV, which this install lacks: pip install 'visionserve[video]'")
        for key in ("url", "model"):
            if not isinstance(body.get(key), str) or not body[key]:
                raise BadInputError(f"a source needs {key!r} (a string)")
        id = body.get("id")
        if id is None:
            id = secrets.token_hex(4)
        elif not isinstance(id, str) or not _ID.fullmatch(id):
            raise BadInputError(f"a source's id is 1-64 letters, digits, '_' or '-', got {shown(id)}")
        if id in self.sources:
            old = self.sources[id]
            if not old.finished:
                raise BadInputError(f"a source {id!r} is running already (DELETE it first)")
            if not old.done.is_set():
                raise OverloadedError(f"source {id!r} is still stopping; try again in a moment")
            del self.sources[id]
            if old.reader.alive:
                self._lingering.add(old)
        settings = self.settings
        url = check_url(
            body["url"],
            source_root=Path(settings.source_root) if settings.source_root else None,
            connect_timeout_s=settings.source_connect_timeout_s,
            read_timeout_s=settings.source_read_timeout_s,
            rtsp_transport=body.get("rtsp_transport", "tcp"),
        )
        running = sum(1 for s in self.sources.values() if not s.finished)
        self._lingering = {s for s in self._lingering if s.reader.alive}
        ending = len(self._lingering) + sum(1 for s in self.sources.values() if s.finished and s.reader.alive)
        if running + ending >= settings.max_sources:
            still = f" ({ending} of them stopped, their readers still ending)" if ending else ""
            raise OverloadedError(
                f"{running + ending} sources are running{still}, the most this server runs (--max-sources)"
            )
        version = body.get("version")
        if isinstance(version, int) and not isinstance(version, bool) and not 1 <= version <= MAX_INT:
            raise BadInputError(f"version must be an integer from 1 to {MAX_INT}, got {shown(version)}")
        where = path.target(self.server, body["model"], None if version is None else str(version), {}, aliases=False)
        options = source_options(where.slot, body, None)
        source = Source(
            id, url, where, options, max_pixels=settings.source_max_pixels,
            connect_timeout_s=settings.source_connect_timeout_s, read_timeout_s=settings.source_read_timeout_s,
            backoff_cap_s=1.0, on_outcome=self.server.stream_outcome(where.slot.name), on_final=self._finished,
        )  # fmt: skip
        if keep:
            self._write(lambda store: store.put(id, {**body, "id": id}))
        self.sources[id] = source
        self._open[source] = contextlib.ExitStack()
        self._open[source].enter_context(self.server.stream_open(source.model, source))
        source.start()
        self._hold(source, True)
        log.info("source %s: %s to %s", id, url.shown, source.model)
        self._forget_oldest()
        return source

    def get(self, id: str) -> Source:
        source = self.sources.get(id)
        if source is None:
            raise NotFoundError(f"no source {id!r}")
        return source

    def describe(self) -> list[dict[str, Any]]:
        return [source.describe() for source in self.sources.values()]

    def states(self) -> list[SourceState]:
        """Every source's metrics record (a copy: the in-process engine reads it on a scrape's thread)."""
        return [source.record(self.server.frontend) for source in list(self.sources.values())]

    def change(self, id: str, body: Any) -> Source:
        """New options for a running source (``PATCH``): those :func:`changeable`; the others stay."""
        source = self.get(id)
        if not isinstance(body, Mapping):
            raise BadInputError("a change is a JSON object of the options to change")
        fixed = sorted(set(body) - set(changeable()))
        if fixed:
            raise BadInputError(f"{', '.join(map(repr, fixed))} cannot change while a source runs (DELETE it and "
                                f"POST it again); changeable: {', '.join(changeable())}")  # fmt: skip
        if source.finished:
            raise BadInputError(f"source {id!r} has {source.state}: nothing to change")
        options = source_options(source.where.slot, body, source.options)
        self._write(lambda store: store.change(id, dict(body)))
        source.change(options)
        return source

    async def delete(self, id: str) -> dict[str, Any]:
        """Stop the source (the frame computing is answered, its reader and decoder freed) and forget it, its row
        removed first. A row that is stored but did not start again (logged why) is removed alone."""
        source = self.sources.get(id)
        removed = self._write(lambda store: store.remove(id))
        if source is None:
            if removed:
                return {"id": id, "state": "stopped", "reason": "deleted", "reader_alive": False}
            raise NotFoundError(f"no source {id!r}")
        await source.stop("deleted", timeout_s=self.settings.drain_timeout_s)
        if self.sources.get(id) is source:
            del self.sources[id]
        if source.reader.alive:  # stopped, but its thread is still in a call that cannot be interrupted
            self._lingering.add(source)
        return source.describe()

    async def close(self) -> None:
        await asyncio.gather(*(s.stop("the server stopped", timeout_s=1.0) for s in list(self.sources.values())))
        if self.store is not None:
            self.store.close()

    # ---- the sources file and the store ---------------------------------------------------------------------
    def start_stored(self, file: str | None) -> list[Source]:
        """Start the sources of ``file`` (a JSON list of POST bodies; their rows stored in place of the stored rows
        of the same ids), then every other stored row, each once: the ones started. A row that cannot start is
        logged with the reason and the others start (a stored one is kept until it is deleted); ConfigError for a
        file that is not such a list, once the stored rows have started."""
        started: list[Source] = []
        problem: ConfigError | None = None
        if file:
            try:
                rows = json.loads(Path(file).read_text())
                if not isinstance(rows, list):
                    raise ConfigError(f"--sources {file}: a JSON list of sources, each as POST /v1/sources takes it")
            except (OSError, ValueError, ConfigError) as exc:
                problem = exc if isinstance(exc, ConfigError) else ConfigError(f"--sources {file}: {exc}")
                rows = []
            for i, row in enumerate(rows):
                if isinstance(row, Mapping) and "id" not in row:
                    row = {**row, "id": file_row_id(row)}  # the same row the same id at each start: stored once
                self._start_row(started, row, True, f"--sources {file}, source {i}")
        done = {s.id for s in started}
        for id, body in self.store.rows() if self.store is not None else []:
            if id not in done and id not in self.sources:
                self._start_row(started, body, False, f"stored source {id}")
        if problem is not None:
            raise problem
        return started

    def _start_row(self, started: list[Source], row: Any, keep: bool, what: str) -> None:
        try:
            started.append(self.create(row, keep=keep))
        except VisionServeError as exc:
            log.error("%s not started: %s", what, exc)
        except Exception as exc:  # a fault of ours: one row must not stop the server (nor the other rows)
            log.exception("%s not started: %s: %s", what, type(exc).__name__, exc)

    # ---- internals --------------------------------------------------------------------------------------------
    def _finished(self, source: Source) -> None:
        if (opened := self._open.pop(source, None)) is not None:
            opened.close()
            self._hold(source, False)
        log.info("source %s %s: %s", source.id, source.state, source.reason)

    def _write(self, write: Any) -> Any:
        """``write(store)`` (committed on return; a few ms on the event loop: admin routes only), or OverloadedError
        when the store cannot be written; nothing without a store."""
        if self.store is None:
            return None
        try:
            return write(self.store)
        except sqlite3.Error as exc:
            log.error("the sources' store %s could not be written: %s", self.store.path, exc)
            raise OverloadedError(f"the sources' store could not be written: {exc}") from None

    def _hold(self, source: Source, hold: bool) -> None:
        """Tell the model's engine that the source holds it resident (never evicted under it), or no longer."""

        async def tell() -> None:
            try:
                await self.server.link_for(source.model).hold(source.model, source.holder, hold)
            except Exception as exc:  # the engine restarts: its holds start afresh, the next frame loads the model
                log.warning("source %s: the engine did not hear of its hold on %s: %s", source.id, source.model, exc)

        task = asyncio.get_running_loop().create_task(tell())
        self._telling.add(task)
        task.add_done_callback(self._telling.discard)

    def _forget_oldest(self) -> None:
        finished = [s for s in self.sources.values() if s.finished]
        for source in finished[: max(0, len(finished) - FINISHED_KEPT)]:
            self.sources.pop(source.id, None)
            if source.reader.alive:
                self._lingering.add(source)


def source_options(slot: ModelSlot, body: Mapping[str, Any], before: SourceOptions | None) -> SourceOptions:
    """A source's options from ``body``, each checked (BadInputError names it); what ``body`` leaves out is as
    ``before`` had it (a change), else the default."""
    max_fps = body.get("max_fps", before.max_fps if before else 0.0)
    if isinstance(max_fps, bool) or not isinstance(max_fps, int | float) or not 0 <= max_fps <= MAX_FPS_LIMIT:
        raise BadInputError(f"max_fps must be a number from 0 (every frame) to {MAX_FPS_LIMIT:g}, got {shown(max_fps)}")
    max_age_ms = stream_max_age(body["max_age_ms"]) if "max_age_ms" in body else (
        before.max_age_ms if before else stream_max_age(None))  # fmt: skip
    pace = body.get("pace", ("realtime" if before.realtime else "answered") if before else "realtime")
    if pace not in ("realtime", "answered"):
        raise BadInputError(f"pace must be 'realtime' (a file at its own rate) or 'answered', got {shown(pace)}")
    keys = [f.name for f in fields(slot.task.Options)]
    wrong = sorted(k for k in body if k in task_keys() and k not in keys)
    if wrong:
        raise BadInputError(f"{', '.join(wrong)}: not an option of {slot.name}'s task ({slot.task.name})")
    task_options = {**(before.task_options if before else {}), **{k: body[k] for k in keys if k in body}}
    want = stream_want(slot, task_options)
    track = read_track(body, before.track if before else None, slot.spec.labels, slot.task.boxes_field is not None)
    return SourceOptions(float(max_fps), max_age_ms, pace == "realtime", want, task_options, track)


def file_row_id(row: Mapping[str, Any]) -> str:
    """The id of a ``--sources`` row that names none: from its content, so the row is the same source at every
    start (stored once, never once more per restart)."""
    text = json.dumps(row, sort_keys=True, separators=(",", ":"), default=str)
    return "file-" + hashlib.sha256(text.encode()).hexdigest()[:12]
