"""Property-based fuzzing (hypothesis) of the input parsers: the v2 binary tensor extension, the image API's
multipart reader and the image-limits checks; and (issue 53) of the surfaces added since, against one in-process
server (:func:`served`): the sources API's bodies, detection's options on every protocol, the WebSocket stream's
frames and query, gRPC stream parameters, and a source URL's secrets.

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


ADMIN_TOKEN = "fuzz-admin-token"
NO_SURROGATES: Any = ("Cs",)  # text that UTF-8 can write (a lone surrogate cannot be sent)
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "model_repository"


def fewer(share: int) -> settings:
    """FUZZ with a ``share``-th of its examples: for properties each of whose examples is a request to a server
    (the profile's 200 each would take the fuzz tests past their 60 s in ``make test``); fuzz-deep still runs many."""
    return settings(FUZZ, max_examples=max(10, (FUZZ.max_examples or 100) // share))


@pytest.fixture(scope="session")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One in-process server (docs/testing.md) for the surfaces added since the image API was fuzzed: the shipped
    ``digits`` classifier and ``digits-detect`` detector (nothing trained), gRPC on, an admin token (the sources
    routes) and a source root holding ``clip.mp4`` (a file never opened: the cases that reach it are refused
    first, or point elsewhere)."""
    import shutil

    from service.core.settings import ServerSettings
    from service.inprocess import InProcessServer

    repo, media = tmp_path_factory.mktemp("fuzz-repo"), tmp_path_factory.mktemp("fuzz-media")
    for name in ("digits", "digits-detect"):
        shutil.copytree(EXAMPLES / name, repo / name)
    (media / "clip.mp4").write_bytes(b"not a video")
    settings_ = ServerSettings(repository=str(repo), port=0, grpc_port=0, admin_token=ADMIN_TOKEN,
                               source_root=str(media), max_sources=64)  # fmt: skip
    with InProcessServer(settings_, grpc=True) as running:
        running.media = media  # type: ignore[attr-defined]
        yield running
