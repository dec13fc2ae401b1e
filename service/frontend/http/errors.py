"""The one place where the exception tree becomes HTTP statuses. Clients never see a stack trace; logs do."""

from __future__ import annotations

import logging

from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException

from service.core.errors import (
    BadInputError,
    DeadlineExceededError,
    NotFoundError,
    OverloadedError,
    PayloadTooLargeError,
    UnsupportedMediaError,
    VisionServeError,
)
from service.frontend.http.validation import record_refused, validation_message

log = logging.getLogger("visionserve.http")

RETRY_AFTER_S = "1"


def status_of(exc: VisionServeError) -> int:
    explicit = getattr(exc, "status", None)  # an overload answered 429 by config, or a refused admin call
    if isinstance(explicit, int):
        return explicit
    if isinstance(exc, UnsupportedMediaError):
        return 415
    if isinstance(exc, PayloadTooLargeError):
        return 413
    if isinstance(exc, BadInputError):
        return 400
    if isinstance(exc, NotFoundError):
        return 404
    if isinstance(exc, OverloadedError):
        return 503
    if isinstance(exc, DeadlineExceededError):
        return 504
    return 500


def error_body(message: str) -> dict[str, str]:
    return {"error": message}


def handle_ours(request: Request, exc: VisionServeError) -> Response:
    status = status_of(exc)
    headers = {"Retry-After": RETRY_AFTER_S} if status in (429, 503) else {}
    if status >= 500 and status != 503:
        log.error("%s %s failed: %s", request.method, request.url.path, exc, exc_info=exc)
    return Response(error_body(str(exc)), status_code=status, headers=headers)


def handle_http(request: Request, exc: HTTPException) -> Response:
    detail = exc.detail or "error"
    if isinstance(exc, ValidationException):
        detail = validation_message(request, exc)
        record_refused(request)
    if exc.status_code == 413:
        detail = f"request body too large: {detail}"
    headers = dict(exc.headers or {})
    return Response(error_body(str(detail)), status_code=exc.status_code, headers=headers)


def handle_unexpected(request: Request, exc: Exception) -> Response:
    log.exception("%s %s failed unexpectedly", request.method, request.url.path, exc_info=exc)
    return Response(error_body("internal server error"), status_code=500)
