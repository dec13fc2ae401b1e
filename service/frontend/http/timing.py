"""One ASGI middleware for what every response carries: ``Server-Timing`` (queue, preprocess, compute,
postprocess, total, and for an answered inference every stage of ``service.core.metrics.STAGES``), an
``X-Request-Id`` (the client's, or a new one), and, with ``--log-format json``, one JSON access-log line per request
with the same split."""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from service.frontend.timing import Timing

access_log = logging.getLogger("visionserve.access")
Scope = dict[str, Any]


@dataclass
class ServerTimingMiddleware:
    app: Any
    json_log: bool = False

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        timing = state.setdefault("timing", Timing())
        started = timing.arrived
        state.setdefault("started_s", started)  # perf_counter at arrival, for requests refused before a handler
        request_id = ""
        for name, value in scope.get("headers", []):
            if name == b"x-request-id":
                request_id = value.decode("latin-1")[:128]
                break
        request_id = request_id or uuid.uuid4().hex
        status = 0

        async def send_with_timing(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", []))
                value = timing.header(time.perf_counter() - started)
                headers.append((b"server-timing", value.encode()))
                headers.append((b"x-request-id", request_id.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_timing)
        finally:
            if self.json_log:
                line = {
                    "ts": time.time(),
                    "request_id": request_id,
                    "method": scope.get("method"),
                    "path": scope.get("path"),
                    "status": status,
                    "duration_ms": round((time.perf_counter() - started) * 1000, 3),
                    "queue_ms": round(timing.queue_s * 1000, 3),
                    "preprocess_ms": round(timing.preprocess_s * 1000, 3),
                    "compute_ms": round(timing.compute_s * 1000, 3),
                    "postprocess_ms": round(timing.postprocess_s * 1000, 3),
                    "client": (scope.get("client") or [None])[0],
                }
                access_log.info(json.dumps(line))
