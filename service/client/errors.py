"""The client's one error: a request refused as a whole, or not answered within the retry policy; and the message
an error answer carries."""

from __future__ import annotations

import msgspec

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


def error_text(body: bytes, empty: str = "(no body)") -> str:
    """The message of an ``{"error": ...}`` answer, else the start of the body as it came (``empty`` for none)."""
    try:
        decoded = msgspec.json.decode(body)
    except msgspec.DecodeError:
        decoded = None
    if isinstance(decoded, dict) and isinstance(decoded.get("error"), str):
        return str(decoded["error"])
    return body[:300].decode(errors="replace") or empty
