"""Property-based fuzzing (hypothesis) of the input parsers: the v2 binary tensor extension, the image API's
multipart reader and the image-limits checks.

Every test here is marked ``reliability``. The examples are bounded for CI by the ``fuzz-ci`` profile
(derandomized, so a CI failure reproduces locally); ``VISIONSERVE_FUZZ_PROFILE=fuzz-deep`` runs many more, with a
fresh random seed each time, for a long local search.
"""

from __future__ import annotations

import os
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "fuzz-ci",
    max_examples=200,
    derandomize=True,
    deadline=None,  # a 2-core CI machine shared with other jobs has pauses that are no defect of ours
    print_blob=True,
    # Building valid images and requests is the point of the strategies, and it is slow-ish by design.
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "fuzz-deep", max_examples=5000, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow]
)

FUZZ = settings.get_profile(os.environ.get("VISIONSERVE_FUZZ_PROFILE", "fuzz-ci"))
"""The settings every fuzz test runs under (apply as a decorator); the profile is chosen by the environment."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.reliability)


@contextmanager
def peak_bytes() -> Iterator[list[int]]:
    """The peak Python allocation inside the block (``[peak]`` once it ends): a declared huge length must be refused
    before anything that size is allocated."""
    out: list[int] = []
    tracemalloc.start()
    try:
        yield out
    finally:
        out.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()


def outcome(call: Callable[[], Any], allowed: tuple[type[BaseException], ...]) -> Any:
    """``call()``'s result, or the allowed exception it raised (returned, not raised); any other exception fails."""
    try:
        return call()
    except allowed as exc:
        return exc
