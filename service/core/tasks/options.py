"""A task's options, declared once as a frozen msgspec Struct, and every reader of them generated from it.

Each field of a task's :class:`Options` carries its type, default and (in ``msgspec.Meta``) its range and
description; ``Meta.extra`` adds what a type cannot say: ``kind="classes"`` (labels or indices, resolved against
the model's labels), ``suppression=True`` (an option of the server's suppression, refused for a graph that
suppresses its own boxes) and ``v2=False`` (an option of the image API's rows that v2 tensors do not have).
:func:`fields` reads the declaration once per type; :func:`read` checks values from any reader (query text,
JSON, v2 parameters, keyword arguments, command-line flags) and refuses one as every protocol words it:
``score_threshold must be a number from 0 to 1, got 'high'``. The front ends derive the OpenAPI schema, the
command line its flags, the client its keywords from :func:`fields`: a new field is one line in its task module.
"""

from __future__ import annotations

import re
import types
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

import msgspec

from service.core.errors import BadInputError, shown

_INTEGER_TEXT = re.compile(r"[+-]?[0-9]{1,19}")  # int() of longer text is slow, or a ValueError past 4300 digits
_FLAG_TEXT = {"true": True, "1": True, "false": False, "0": False}


class Options(msgspec.Struct, frozen=True, kw_only=True):
    """The base of every task's options (a classifier's ``top_k``, a detector's thresholds)."""


@dataclass(frozen=True, slots=True)
class Field:
    """One option as its readers see it: ``kind`` is ``number``, ``integer``, ``flag``, ``choice`` or ``classes``;
    ``low``/``high`` its bounds (inclusive), ``choices`` a choice's values, ``v2``: taken as a v2 parameter."""

    name: str
    kind: str
    default: Any
    description: str
    low: float | None = None
    high: float | None = None
    choices: tuple[str, ...] = ()
    suppression: bool = False
    v2: bool = True

    @property
    def allowed(self) -> str:
        """What the option takes, as a message says it."""
        if self.kind == "flag":
            return "true or false"
        if self.kind == "choice":
            return f"one of {', '.join(self.choices)}"
        if self.kind == "classes":
            return "a list of class labels or indices"
        what = "an integer" if self.kind == "integer" else "a number"
        return f"{what} from {self.low:g} to {self.high:g}" if self.low is not None else what

    @property
    def described(self) -> str:
        """The option for a person: what it is, what it takes and its default."""
        default = "none" if self.default is None else str(self.default).lower()
        return f"{self.description}: {self.allowed} (default {default})"

    @property
    def flag_name(self) -> str:
        return "--" + self.name.replace("_", "-")


@cache
def fields(options: type[Options]) -> tuple[Field, ...]:
    """The options of ``options``, from its declaration (read once per type)."""
    hints = get_type_hints(options, include_extras=True)
    out = []
    for name, default in zip(options.__struct_fields__, options.__struct_defaults__, strict=True):
        kind_type, metas = hints[name], []
        while get_origin(kind_type) is Annotated:
            kind_type, *more = get_args(kind_type)
            metas += [m for m in more if isinstance(m, msgspec.Meta)]
        keys = ("ge", "le", "description", "extra")
        meta = {k: getattr(m, k) for m in metas for k in keys if getattr(m, k) is not None}
        extra = meta.get("extra") or {}
        kind, choices = _kind(kind_type, extra)
        out.append(Field(
            name, kind, default, meta.get("description", ""), meta.get("ge"), meta.get("le"), choices,
            bool(extra.get("suppression")), bool(extra.get("v2", True)),
        ))  # fmt: skip
    return tuple(out)


def _kind(kind_type: Any, extra: Mapping[str, Any]) -> tuple[str, tuple[str, ...]]:
    if extra.get("kind") == "classes":
        return "classes", ()
    if get_origin(kind_type) is Literal:
        return "choice", tuple(get_args(kind_type))
    if get_origin(kind_type) in (Union, types.UnionType):
        kind_type = next(a for a in get_args(kind_type) if a is not type(None))
    return {bool: "flag", int: "integer", float: "number"}[kind_type], ()


def read(
    options: type[Options],
    values: Mapping[str, Any],
    labels: tuple[str, ...] | None,
    *,
    where: str = "",
    said: str = "",
    text: bool = False,
    v2: bool = False,
    before: Options | None = None,
    default: Options | None = None,
) -> Any:
    """``options`` from ``values`` (those it declares; other keys are the caller's), each checked: BadInputError
    names the first wrong one (``where``: its prefix, ``parameters.``; ``said``: a suffix, `` (query parameter)``).
    ``text``: values are a query's or a flag's text (a repeated ``classes`` a list of texts); ``v2``: only the
    options v2 takes; what ``values`` leaves out is as ``before`` (a change), else ``default``, else declared.
    ``labels`` None: no model's yet, so classes are not read (the ranges alone are checked)."""
    base = before or default or options()
    taken = {}
    for field in fields(options):
        if field.name in values and (field.v2 or not v2) and (labels is not None or field.kind != "classes"):
            taken[field.name] = check(field, values[field.name], labels or (), where, said, text, v2)
    return msgspec.structs.replace(base, **taken) if taken else base


def check(
    field: Field,
    value: Any,
    labels: tuple[str, ...],
    where: str = "",
    said: str = "",
    text: bool = False,
    v2: bool = False,
) -> Any:
    """One option's value, checked (and read from text where ``text``). A v2 ``classes`` may also be one string
    separated by commas, or one class alone: a gRPC ``InferParameter`` holds no list."""
    name, sent = f"{where}{field.name}", value
    if field.kind == "classes":
        if isinstance(value, str) and (text or v2):
            value = [c for c in value.split(",") if c.strip()]
        elif v2 and not isinstance(value, list):
            value = [value]
        if not isinstance(value, list | tuple):
            raise BadInputError(f"{name} must be {field.allowed}, got {shown(value)}{said}")
        return class_indices(name, value, labels)
    if text and isinstance(value, str):
        value = _from_text(field.kind, value)
    if field.kind == "flag":
        ok = isinstance(value, bool)
    elif field.kind == "choice":
        ok = isinstance(value, str) and value in field.choices
    else:  # a bool is no number here; NaN fails the range
        ok = not isinstance(value, bool) and isinstance(value, int if field.kind == "integer" else int | float)
        ok = ok and _within(field, value)
        value = float(value) if ok and field.kind == "number" else value
    if not ok:
        raise BadInputError(f"{name} must be {field.allowed}, got {shown(sent)}{said}")
    return value


def _within(field: Field, value: float) -> bool:
    low = -float("inf") if field.low is None else field.low
    high = float("inf") if field.high is None else field.high
    return low <= value <= high


def _from_text(kind: str, text: str) -> Any:
    """A query's or flag's text as the type its check takes; text that is not one goes on as it is, for the check
    to refuse with the value sent."""
    if kind == "number":
        try:
            return float(text)
        except ValueError:
            return text
    if kind == "integer":
        return int(text) if _INTEGER_TEXT.fullmatch(text.strip()) else text
    if kind == "flag":
        return _FLAG_TEXT.get(text.strip().lower(), text)
    return text


def as_query(options: type[Options], values: Mapping[str, Any], call: str) -> dict[str, Any]:
    """Keyword arguments (the client's) as the route's query: those given (None: the server's default), lists as
    repeated texts; TypeError naming a keyword that is no option of ``options``, as a misspelt keyword gets."""
    names = {f.name for f in fields(options)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise TypeError(f"{call}() got an unexpected keyword argument {unknown[0]!r}")
    return {name: _as_text(value) for name, value in values.items() if value is not None}


def _as_text(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return [str(v) for v in value]
    return ("true" if value else "false") if isinstance(value, bool) else value


def class_indices(name: str, values: Any, labels: tuple[str, ...]) -> tuple[int, ...]:
    """Each class named by its label or its index in ``labels``; an unknown one is refused (BadInputError, naming
    ``name``), listing the labels. A number of any length is refused as an index past the labels, never written out
    or read whole (Python's ``int`` and ``str`` refuse more than 4300 digits with a ValueError)."""
    out = []
    for value in values:
        number = isinstance(value, int) and not isinstance(value, bool)
        text = "" if number and value.bit_length() > 64 else str(value).strip()
        digits = not isinstance(value, bool) and text.isascii() and text.isdigit() and len(text) <= 20
        if text and text in labels:
            out.append(labels.index(text))
        elif number and 0 <= value < len(labels):
            out.append(value)
        elif digits and int(text) < len(labels):
            out.append(int(text))
        else:
            shown_labels = ", ".join(labels[:20]) + (", ..." if len(labels) > 20 else "")
            raise BadInputError(
                f"{name}: unknown class {shown(value)}: name a label ({shown_labels}) or an index from 0 to "
                f"{len(labels) - 1}"
            )
    return tuple(sorted(set(out)))
