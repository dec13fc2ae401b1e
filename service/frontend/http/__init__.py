"""The HTTP layer: handlers only decode, submit and encode. Imports the transport, never the engine."""

from __future__ import annotations

from service.frontend.http.app import create_app

__all__ = ["create_app"]
