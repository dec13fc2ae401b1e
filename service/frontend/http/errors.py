"""Our errors and litestar's as JSON answers. Each error of ours carries its own status
(:mod:`service.core.errors`); clients never see a stack trace, logs do."""

from __future__ import annotations

import logging

from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException

from service.core.errors import VisionServeError
from service.frontend.http.validation import record_refused, validation_message

log = logging.getLogger("visionserve.http")


def handle_ours(request: Request, exc: VisionServeError) -> Response:
    status = exc.http_status
    headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s is not None else {}
    if status >= 500 and status != 503:
        log.error("%s %s failed: %s", request.method, request.url.path, exc, exc_info=exc)
    return Response({"error": str(exc)}, status_code=status, headers=headers)


def handle_http(request: Request, exc: HTTPException) -> Response:
    detail = exc.detail or "error"
    if isinstance(exc, ValidationException):
        detail = validation_message(request, exc)
        record_refused(request)
    if exc.status_code == 413:
        detail = f"request body too large: {detail}"
    return Response({"error": str(detail)}, status_code=exc.status_code, headers=dict(exc.headers or {}))


def handle_unexpected(request: Request, exc: Exception) -> Response:
    log.exception("%s %s failed unexpectedly", request.method, request.url.path, exc_info=exc)
    return Response({"error": "internal server error"}, status_code=500)
