"""Flags declared as a table, for every scenario: ``(flag, default, help[, kind])``, sizes that depend on a switch
(``--quick``, ``--dry-run``), and refusing a bad combination. The standard library only: the GPU scenarios parse
their flags before the carried wheels are installed (:mod:`service.bench.runner`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Mapping
from typing import Any

Flag = tuple[Any, ...]  # (flag, default, help[, type, or a tuple of choices])
FIGURES = ("engine", "pipeline", "decode", "batcher", "fake", "candidates")  # `bench engine --figures`


def add_flags(p: argparse.ArgumentParser, flags: Iterable[Flag]) -> None:
    """Each ``(flag, default, help[, kind])`` as an argument: the default's type unless ``kind`` names one (a tuple:
    the choices); False makes a switch, a list takes any number of words. The help states the default
    (service.core.arguments.HelpFormatter adds it where the text does not say it)."""
    for name, default, text, *kind in flags:
        if default is False:
            p.add_argument(name, action="store_true", help=f"{text} (default: off)")
        elif isinstance(default, list):  # any number of words
            p.add_argument(name, nargs="*", default=default, help=text)
        elif kind and isinstance(kind[0], tuple):
            p.add_argument(name, default=default, choices=kind[0], help=text)
        else:
            kind = kind or [str if default is None else type(default)]
            p.add_argument(name, default=default, type=kind[0], help=text)


def sized(sizes: Mapping[str, tuple[Any, ...]], switch: str = "--quick") -> list[Flag]:
    """Flags whose default depends on ``switch``: ``key: (full, small, help[, kind])``; :func:`settle` fills them in."""
    flags: list[Flag] = []
    for key, (full, small, text, *kind) in sizes.items():
        said = f"{text} (default: {show(full)}; {show(small)} with {switch})"
        flags.append((f"--{key.replace('_', '-')}", None, said, *(kind or [type(full)])))
    return flags


def show(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, list | tuple) else str(value)


def settle(args: argparse.Namespace, sizes: Mapping[str, tuple[Any, ...]], small: bool | None = None) -> Any:
    """Each of ``sizes`` not given on the command line: its small value when ``small`` (default: ``--quick``)."""
    small = args.quick if small is None else small
    for key, (full, little, *_) in sizes.items():
        if getattr(args, key) is None:
            setattr(args, key, little if small else full)
    return args


def ints(text: str) -> list[int]:
    """``--batch-sizes 1,8,32``: comma-separated positive integers (service.core.arguments.comma_ints needs msgspec,
    which the GPU machine lacks until the install step)."""
    values = [int(x) for x in text.split(",") if x.strip().isdigit()]
    if not values or min(values) < 1 or len(values) != len([x for x in text.split(",") if x.strip()]):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def refused(*checks: tuple[bool, str]) -> bool:
    """Print what is wrong with the flags (each ``(wrong, why)``); whether anything is."""
    wrong = [why for bad, why in checks if bad]
    if wrong:
        print("; ".join(wrong), file=sys.stderr)
    return bool(wrong)
