"""An ASGI middleware that puts ``Server-Timing`` on every response (queue, preprocess, compute, total)."""

from __future__ import annotations

import time
from typing import Any

from service.http.state import Timing

Scope = dict[str, Any]


class ServerTimingMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        state = scope.setdefault("state", {})
        timing = state.setdefault("timing", Timing())

        async def send_with_timing(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                value = timing.header(time.perf_counter() - started)
                headers.append((b"server-timing", value.encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_timing)
