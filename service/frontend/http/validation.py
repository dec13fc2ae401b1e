"""Requests that litestar refuses before a handler runs (a query parameter of the wrong type or out of range).

litestar answers them ``Validation failed for POST /v1/...`` and keeps the useful part (which parameter, what is
wrong) in ``extra``; this module writes it as the rest of the API does: the parameter, the value sent and what is
allowed (``top_k must be an integer from 1 to 1000, got '0' (query parameter)``). Such a request is still a request
for a model: handlers that record requests (``opt={"records_requests": True}``) get it counted as ``bad_input``,
which it was not, since the handler that records never ran.
"""

from __future__ import annotations

import re
import time
import types
from typing import Any, Union, get_args, get_origin

from litestar import Request
from litestar.connection import ASGIConnection
from litestar.exceptions import ValidationException
from litestar.handlers.base import BaseRouteHandler
from litestar.params import ParameterKwarg

from service.core.errors import VisionServeError
from service.frontend.state import ServerState

KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
_INTEGER = re.compile(r"-?[0-9]+")


def validation_message(request: Request[Any, Any, Any], exc: ValidationException) -> str:
    """One sentence per refused parameter: its name, the value sent and what is allowed."""
    errors = exc.extra if isinstance(exc.extra, list) else []
    handler = request.scope.get("route_handler")
    try:
        fields = dict(handler.parsed_fn_signature.parameters) if handler is not None else {}
    except Exception:  # a handler without a parsed signature: the message falls back to litestar's words
        fields = {}
    parts = []
    for error in errors:
        if not isinstance(error, dict) or not error.get("key"):
            continue
        key = str(error["key"])
        source = error.get("source")
        source = getattr(source, "value", source)  # litestar's ParamType, a str enum: "query", "path", ...
        sent = request.query_params.get(key) if source == "query" else request.path_params.get(key)
        allowed = _allowed(fields.get(key))
        said = f"{key} must be {allowed}" if allowed else f"{key}: {error.get('message', 'invalid')}"
        got = f", got {sent!r}" if sent is not None else ""
        where = f" ({source} parameter)" if source else ""
        parts.append(f"{said}{got}{where}")
    return "; ".join(parts) or str(exc.detail)


def integer_queries(connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler) -> None:
    """A guard: an integer query parameter takes integer text only. litestar reads other text through a float, so
    ``priority=1e-400`` was taken as 0 (found by tests/fuzz/test_parameters.py) and ``top_k=1.0000000000000000001``
    as 1. Refused as litestar refuses (a ValidationException), so the message and the ``bad_input`` count are the
    same as for any other refused query parameter."""
    fields = dict(handler.parsed_fn_signature.parameters)
    bad = [
        {"key": key, "message": "Expected `int`", "source": "query"}
        for key, value in connection.query_params.multi_items()
        if key in fields and _kind(fields[key]) is int and not _INTEGER.fullmatch(value)
    ]
    if bad:
        raise ValidationException(f"Validation failed for {connection.scope.get('method')} {connection.url}", extra=bad)


def record_refused(request: Request[Any, Any, Any]) -> None:
    """Count a refused request under its model version, where the route records requests and names a served model."""
    handler = request.scope.get("route_handler")
    if handler is None or not handler.opt.get("records_requests"):
        return
    server: ServerState | None = getattr(request.app.state, "server", None)
    model = request.path_params.get("model")
    if server is None or not isinstance(model, str):
        return
    try:
        slot = server.slot(model, request.path_params.get("version"))
    except VisionServeError:
        return  # an unknown model or version: nothing to count it under
    started = request.scope.get("state", {}).get("started_s")
    slot.record_refused(time.perf_counter() - started if started is not None else 0.0)


def _allowed(field: Any) -> str:
    """What a parameter takes, from its annotation and its ``Parameter(ge=..., le=...)``: "an integer from 1 to
    1000"; empty when unknown."""
    if field is None:
        return ""
    kind = KINDS.get(_kind(field), "")
    if not kind:
        return ""
    bounds = field.kwarg_definition if isinstance(field.kwarg_definition, ParameterKwarg) else None
    if bounds is None:
        return kind
    low = (">=", bounds.ge) if bounds.ge is not None else (">", bounds.gt) if bounds.gt is not None else None
    high = ("<=", bounds.le) if bounds.le is not None else ("<", bounds.lt) if bounds.lt is not None else None
    if low and high and low[0] == ">=" and high[0] == "<=":
        return f"{kind} from {_number(low[1])} to {_number(high[1])}"
    said = " and ".join(f"{op} {_number(value)}" for op, value in (b for b in (low, high) if b is not None))
    return f"{kind} {said}" if said else kind


def _kind(field: Any) -> Any:
    """A parameter's type, ``X`` for ``X | None``."""
    annotation = field.annotation
    if get_origin(annotation) in (Union, types.UnionType):
        annotation = next((a for a in get_args(annotation) if a is not type(None)), annotation)
    return annotation


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)
