"""Numeric request parameters at their edges: one range per parameter, checked alike for the image API's query
strings, the v2 JSON ``parameters`` and gRPC's ``InferParameter`` values, and one message per refusal that names the
parameter, the value sent and what is allowed: ``parameters.priority must be an integer from 0 to
9223372036854775807, got -1``.

Integers stop at int64's largest (:data:`MAX_INT`): every layer carries that much and no layer carries more (gRPC's
``int64_param``, msgspec's constraints, which litestar's query parameters use, and the transport's msgpack; a
priority of 2**64 used to reach the transport and fail there, a 500). A boolean is never taken for a number, nor a
number for a boolean.

JSON has no NaN or Infinity (RFC 8259), yet Python's ``json`` writes them, and a number past float64's range
(``1e400``) decodes to nothing finite; an integer of more than 4300 digits is JSON but neither Python's ``int`` nor
msgspec reads it. msgspec refuses each with its position only; :func:`json_number_error` finds such a value and
says where it sits and what that place takes.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Mapping
from typing import Any, TypeVar

from service.core.errors import BadInputError, shown

T = TypeVar("T")
MAX_INT = 2**63 - 1
MAX_TOP_K = 1000  # the most predictions an image's answer lists (the classify route, streams and sources)
MAX_TIMEOUT_MS = MAX_INT / 1000  # the image API's timeout_ms: what parameters.timeout takes in microseconds
TIMEOUT = f"a number of microseconds from 0 to {MAX_INT} (0: no timeout)"
PRIORITY = f"an integer from 0 to {MAX_INT} (lower is served first; 0: the default level)"
CLASSIFICATION = f"an integer from 1 to {MAX_INT} (more than the model's classes gives them all)"
FLAG = "true or false"
# What each parameter of the v2 protocol takes, by its name in a ``parameters`` object, for the messages.
ALLOWED = {
    "timeout": TIMEOUT,
    "priority": PRIORITY,
    "classification": CLASSIFICATION,
    "binary_data_size": "an integer >= 0 (the input's bytes in the binary part of the body)",
    "binary_data_output": FLAG,
    "binary_data": FLAG,
}
# Python's json writes these; msgspec (rightly) refuses them. Only bodies up to this size are read a second time to
# say which value it was: a second, slower parse of a large body is not worth a better message.
_LENIENT_MAX_BYTES = 1 << 20
_NOT_JSON = re.compile(rb"NaN|Infinity|[0-9][eE][+-]?[0-9]{3,}|[0-9]{300,}")


def integer(name: str, value: Any, low: int, allowed: str, high: int = MAX_INT) -> int:
    """``value`` if it is an integer from ``low`` to ``high`` (a bool is not), else BadInputError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadInputError(f"{name} must be {allowed}, got {shown(value)}")
    return value


def flag(name: str, value: Any, default: bool = False) -> bool:
    """A boolean parameter (``binary_data``, ``binary_data_output``): true, false or absent, nothing else."""
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadInputError(f"{name} must be {FLAG}, got {shown(value)}")
    return value


def request_options(params: dict[str, Any], where: str = "parameters") -> tuple[int, float | None]:
    """(priority, timeout_ms) from the request parameters ``priority`` and ``timeout`` (microseconds; 0 or absent:
    none). Triton takes integers only for both; a fractional timeout is taken too, as it always was here."""
    timeout_us = params.get("timeout")
    if timeout_us is not None and (
        isinstance(timeout_us, bool)
        or not isinstance(timeout_us, int | float)
        or not 0 <= timeout_us <= MAX_INT  # False for NaN, so NaN is refused too
    ):
        raise BadInputError(f"{where}.timeout must be {TIMEOUT}, got {shown(timeout_us)}")
    priority = integer(f"{where}.priority", params.get("priority", 0), 0, PRIORITY)
    return priority, (timeout_us / 1000.0) if timeout_us else None


def classification_k(value: Any, classes: int, where: str = "classification") -> int:
    """The classification extension's k, checked and capped at ``classes`` (as Triton caps it)."""
    return min(integer(where, value, 1, CLASSIFICATION), classes)


def version_number(version: int | str | None) -> int | None:
    """A model version from a path or a request field: None (or empty) for the latest, else an integer from 1 to
    :data:`MAX_INT` written in ASCII digits (``int()`` alone also took ``" 1"``, ``"1_0"`` and ``"١"``)."""
    if version is None or version == "":
        return None
    text = str(version)
    if not (text.isascii() and text.isdigit() and len(text) <= len(str(MAX_INT))) or not 1 <= int(text) <= MAX_INT:
        raise BadInputError(f"model version must be a positive integer, from 1 to {MAX_INT}, got {text!r}")
    return int(text)


def json_number_error(text: bytes) -> str | None:
    """Why a JSON body msgspec refused is wrong, when the cause is a number JSON cannot hold (NaN, Infinity, or past
    float64's range) or an integer too long to read: the first such value's place and, for a known parameter, what
    it takes. None otherwise."""
    if len(text) > _LENIENT_MAX_BYTES or not _NOT_JSON.search(text):
        return None
    try:
        doc = json.loads(text, parse_float=_float, parse_int=_int, parse_constant=_Token)
    except (ValueError, RecursionError):
        return None
    found = _first_token(doc, "")
    if found is None:
        return None
    path, token = found
    name = path.rsplit(".", 1)[-1]
    allowed = ALLOWED.get(name) if ".parameters." in f".{path}" else None
    if token.isdigit():  # an integer past what int() reads
        what = allowed or f"an integer of at most {sys.get_int_max_str_digits()} digits"
        return f"{path} must be {what}, got an integer of {len(token)} digits"
    said = f"{path} must be {allowed}" if allowed else f"{path} must be a number JSON can hold"
    return f"{said}, got {token} (JSON has no NaN or Infinity, and no number past float64's range: RFC 8259)"


class _Token(str):
    """A number that JSON cannot hold, as it was written (``NaN``, ``1e400``), or the digits of an integer too long
    to read."""


def _float(text: str) -> float | _Token:
    value = float(text)
    return value if math.isfinite(value) else _Token(text)


def _int(text: str) -> int | _Token:
    """An integer, or a token for one that Python's ``int`` will not read (0: this interpreter reads any)."""
    digits, limit = text.lstrip("-"), sys.get_int_max_str_digits()
    return _Token(digits) if limit and len(digits) > limit else int(text)


def _first_token(value: Any, path: str) -> tuple[str, str] | None:
    if isinstance(value, _Token):
        return path or "the body", str(value)
    if isinstance(value, dict):
        items = ((f"{path}.{key}" if path else str(key), item) for key, item in value.items())
    elif isinstance(value, list):
        items = ((f"{path}[{i}]", item) for i, item in enumerate(value))
    else:
        return None
    return next((found for where, item in items if (found := _first_token(item, where)) is not None), None)


def load_config(parameters: Mapping[str, T]) -> T | None:
    """A load request's ``config`` parameter (None without one), HTTP and gRPC alike: applied or refused, never
    ignored; any other parameter (Triton's ``file:...`` overrides) is refused."""
    unknown = sorted(set(parameters) - {"config"})
    if unknown:
        raise BadInputError(f"load parameters {unknown} are not supported; only 'config' is")
    return parameters.get("config")
