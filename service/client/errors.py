"""The client's one error: a request refused as a whole, or not answered within the retry policy."""

from __future__ import annotations

from service.core.errors import VisionServeError


class ClientError(VisionServeError):
    """A request the server refused as a whole, or that could not be sent within the retry policy.

    ``status`` is the HTTP status the server answered (None when no answer came: connection refused or dropped on
    every attempt).
    """

    def __init__(self, message: str, *, status: int | None = None, retries: int = 0) -> None:
        super().__init__(message)
        self.status = status
        self.retries = retries
