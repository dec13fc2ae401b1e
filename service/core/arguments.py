"""argparse types shared by every command line (the server's, the load tester's, the scripts')."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from typing import Any

from service.core.tasks.options import Options, fields

# A help text that already states its default ("(default: ImageNet)", "default: the next free one").
_STATES_DEFAULT = re.compile(r"\(default\b|\bdefault\s*:", re.IGNORECASE)


def comma_ints(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated integers, each >= 1 (batch sizes, concurrency steps)."""
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"values must be >= 1, got {text!r}")
    return values


def comma_floats(text: str) -> tuple[float, ...]:
    """An argparse type: comma-separated numbers, each > 0 (request rates)."""
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"values must be > 0, got {text!r}")
    return values


def size_pair(text: str) -> tuple[int, int]:
    """An argparse type: WIDTHxHEIGHT in pixels."""
    try:
        width, height = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT, e.g. 500x375, got {text!r}") from None
    if min(width, height) < 1:
        raise argparse.ArgumentTypeError(f"width and height must be >= 1, got {text!r}")
    return width, height


def integer_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer from ``low`` to ``high``. argparse names the flag in its usage error
    (``argument --top-k: must be an integer from 1 to 1000, got '0'``), exit status 2."""

    def parse(text: str) -> int:
        stripped = text.strip()
        digits = stripped.removeprefix("-").removeprefix("+")
        # ASCII digits only, and no more than the bounds have: int() also takes "1_000" and "١", and a 100000-digit
        # string costs it time before it refuses one past its digit limit.
        ok = digits.isascii() and digits.isdigit() and len(digits) <= max(len(str(low)), len(str(high))) + 1
        if not ok or not low <= int(stripped) <= high:
            raise argparse.ArgumentTypeError(f"must be an integer from {low} to {high}, got {text!r}")
        return int(stripped)

    parse.__name__ = f"integer from {low} to {high}"
    return parse


def number_in(low: float, high: float, *, above: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number from ``low`` (or, with ``above``, more than ``low``) to ``high``; NaN and
    the infinities, which ``float()`` takes, are refused."""
    allowed = f"a number > {low:g} and <= {high:g}" if above else f"a number from {low:g} to {high:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}") from None
        if not math.isfinite(value) or not (low < value if above else low <= value) or value > high:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}")
        return value

    parse.__name__ = allowed
    return parse


def default_text(action: argparse.Action) -> str | None:
    """``action``'s default as a user would type it (``1,4,16``, ``500x375``), or None when there is none to show:
    no default, a flag (store_true), or a help text that already says it."""
    default: Any = action.default
    if default is None or default is argparse.SUPPRESS or default == "" or action.nargs == 0:
        return None
    if not action.option_strings and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
        return None  # a required positional
    if _STATES_DEFAULT.search(action.help or ""):
        return None
    if isinstance(default, tuple | list):
        return ("x" if action.type is size_pair else ",").join(str(v) for v in default)
    return str(default)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every flag's help states its default once, written as it would be typed: ``(default: 1,4,16)``, not Python's
    ``(1, 4, 16)``; nothing for flags without a value or a default (argparse's ArgumentDefaultsHelpFormatter printed
    ``(default: None)`` and ``(default: False)``, and a second default after help that already gave one)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        shown = None if text is argparse.SUPPRESS else default_text(action)
        return text if shown is None else f"{text} (default: {shown.replace('%', '%%')})"  # argparse %-formats help


def add_option_flags(p: argparse._ActionsContainer, *options: type[Options]) -> None:
    """A flag for each of the tasks' options (``--score-threshold``), its range and help from the declaration (an
    option several tasks take: once, as the first declares it); left out, a flag is None and the option is the
    model's default."""
    seen: set[str] = set()
    for f in (f for o in options for f in fields(o)):
        if f.name in seen:
            continue
        seen.add(f.name)
        help = f.described
        if f.kind == "flag":
            p.add_argument(f.flag_name, action="store_true", default=None, help=help)
        elif f.kind == "choice":
            p.add_argument(f.flag_name, choices=f.choices, default=None, help=help)
        elif f.kind == "classes":
            p.add_argument(f.flag_name, nargs="+", default=None, metavar="CLASS", help=help)
        else:
            assert f.low is not None and f.high is not None  # every numeric option is declared with its range
            kind = integer_in(int(f.low), int(f.high)) if f.kind == "integer" else number_in(f.low, f.high)
            p.add_argument(f.flag_name, type=kind, default=None, help=help)


def option_flags(args: argparse.Namespace, *options: type[Options]) -> dict[str, Any]:
    """The tasks' options the command line set (by :func:`add_option_flags`)."""
    names = dict.fromkeys(f.name for o in options for f in fields(o))
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
