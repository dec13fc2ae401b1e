"""The HTTP layer: handlers only decode, submit and encode. Imports ``service.batching``, never the reverse."""

from __future__ import annotations

from service.http.app import create_app

__all__ = ["create_app"]
