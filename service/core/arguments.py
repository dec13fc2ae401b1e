"""argparse types shared by every command line (the server's, the load tester's, the scripts')."""

from __future__ import annotations

import argparse


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
