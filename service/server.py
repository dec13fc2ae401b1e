"""``visionserve serve``: the app on uvicorn (uvloop and httptools where installed), with a graceful SIGTERM.

On SIGTERM (or Ctrl-C) readiness turns false and new inference is refused with 503 at once; uvicorn stops
accepting connections and waits for requests in flight up to ``drain_timeout_s``; the lifespan then drains and
closes every model's queue within the same bound, and the process exits.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import sys
import time
from typing import Any

import msgspec
import uvicorn

from service.http.app import SETTINGS_ENV, create_app
from service.settings import ServerSettings

log = logging.getLogger("visionserve.server")


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: Any) -> None:
        super().__init__(config)
        self.visionserve_app = app

    def handle_exit(self, sig: int, frame: Any) -> None:
        state = getattr(self.visionserve_app.state, "server", None)
        if state is not None and not state.draining:
            state.draining = True  # readiness false, new inference refused; in-flight requests finish
            log.warning("signal %s: draining (up to %.1f s), then exiting", sig, state.settings.drain_timeout_s)
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM and sig in self._captured_signals:
            # uvicorn re-raises the signal once it has shut down; a clean drain on SIGTERM exits 0 instead.
            self._captured_signals.remove(sig)


def uvicorn_options(settings: ServerSettings, log_level: str) -> dict[str, Any]:
    return {
        "host": settings.host,
        "port": settings.port,
        "loop": "uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        "http": "httptools" if importlib.util.find_spec("httptools") else "h11",
        "lifespan": "on",
        "log_level": log_level,
        "access_log": False,
        "timeout_graceful_shutdown": max(1, int(settings.drain_timeout_s)),
    }


def _json_access_log() -> None:
    """One JSON line per request on stdout, whatever the log level of everything else."""
    access = logging.getLogger("visionserve.access")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    access.handlers[:] = [handler]
    access.setLevel(logging.INFO)
    access.propagate = False


def serve(settings: ServerSettings, *, workers: int = 1, log_level: str = "info") -> None:
    if settings.log_format == "json":
        _json_access_log()
    options = uvicorn_options(settings, log_level)
    if workers > 1:
        os.environ[SETTINGS_ENV] = json.dumps(msgspec.to_builtins(settings))
        uvicorn.run("service.http.app:app_from_env", factory=True, workers=workers, **options)
        return
    app = create_app(settings)
    server = _Server(uvicorn.Config(app, **options), app)
    # uvicorn restores the handler it found once it has shut down. Outside its run (before start-up, or after the
    # drain while threads and the loop wind down) a SIGTERM, e.g. a supervisor repeating itself, means "exit now",
    # and nothing accepted is left: exit 0 rather than die by the signal.
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    started = time.perf_counter()
    server.run()
    log.info("stopped after %.1f s", time.perf_counter() - started)
