"""A real server process on 127.0.0.1 and a free port, serving a repository built for the tests.

Two rules keep these tests true on any machine (docs/testing.md):

- A model that must be slow, busy or overloaded is slow because its config.toml says so (``[faults] delay_ms``:
  :func:`slow_config`), never because the CPU is slow: a resnet18 that took 40 ms a batch here took 14 ms on a
  faster machine, and three tests that relied on it failed there.
- Every server a test starts is stopped when the test ends, passed or failed (:func:`stop_leftover_servers`).

With ``VISIONSERVE_TEST_FAST_MODELS=1`` every model a server loads is served by the noop runtime (no model work;
its ``[faults]`` delays kept), except those named in ``real_models`` (default: the trained ``digits``, whose
answers tests check and whose forward costs well under a millisecond here anyway): the suite run so proves that no
test depends on how long a real model takes.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service import launcher
from service.core.settings import ServerSettings
from service.inprocess import InProcessServer
from service.launcher import RunningServer, free_port
from tests.conftest import SLOW_DELAY_MS, slow_config

__all__ = ["ADMIN_TOKEN", "SLOW_DELAY_MS", "RunningServer", "free_port", "slow_config", "start_server", "stop_server"]

ADMIN_TOKEN = "test-admin-token"
FAST_MODELS_ENV = "VISIONSERVE_TEST_FAST_MODELS"
_STARTED: list[RunningServer] = []


def fast_models() -> bool:
    return os.environ.get(FAST_MODELS_ENV, "") not in ("", "0")


def _serve_noop(repo: Path, real_models: tuple[str, ...]) -> None:
    """Under the fast-model switch: every model of ``repo`` not in ``real_models`` gets ``[faults] noop = true``
    (its own ``[faults]`` table, where it has one, keeps its other drills)."""
    for model in sorted(p for p in repo.iterdir() if p.is_dir() and p.name not in real_models):
        config = model / "config.toml"
        lines = config.read_text().splitlines() if config.exists() else []
        lines = [line for line in lines if not line.replace(" ", "").startswith("noop=")]
        table = next((i for i, line in enumerate(lines) if line.strip() == "[faults]"), None)
        if table is None:
            lines += ["[faults]", "noop = true"]
        else:
            lines.insert(table + 1, "noop = true")
        config.write_text("\n".join(lines) + "\n")


def start_server(
    repo: Path,
    log: Path,
    *extra: str,
    ready_timeout_s: float = 120,
    real_models: tuple[str, ...] = ("digits",),
    port: int | None = None,
    grpc_port: int | None = None,
) -> RunningServer:
    """A server on a free port (or ``port``), ready (``service.launcher``); ``real_models``: kept real under the
    fast-model switch; stopped when the test that started it ends."""
    if fast_models():
        _serve_noop(repo, real_models)
    if "--state-dir" not in extra:  # its sources kept beside its log, never in a repository other tests share
        extra = (*extra, "--state-dir", str(log.parent / f"{log.stem}.state"))
    running = launcher.start(repo, *extra, log=log, port=port, grpc_port=grpc_port, ready_timeout_s=ready_timeout_s)
    _STARTED.append(running)
    return running


def stop_server(server: RunningServer, timeout_s: float = 30) -> int:
    """SIGTERM, then the whole process group killed if it has not exited within ``timeout_s``; its exit code."""
    return launcher.stop(server, timeout_s)


def stop_leftover_servers(since: int = 0) -> list[RunningServer]:
    """Stop every server started (``_STARTED[since:]``) that still runs; the ones that did."""
    left = launcher.stop_all(_STARTED[since:])
    del _STARTED[since:]
    return left


def metric_value(url: str, name: str, **labels: str) -> float:
    """``name``'s value in the server's /metrics, summed over the samples whose labels include ``labels``."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") and all(w in line for w in want):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_for_metric(url: str, name: str, at_least: float, timeout_s: float = 30, **labels: str) -> float:
    """Until ``name`` (see :func:`metric_value`) reaches ``at_least``; bounded by ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = metric_value(url, name, **labels)
        if value >= at_least:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{name}{labels} stayed at {value} (< {at_least}) for {timeout_s} s")
        time.sleep(0.02)


@contextlib.contextmanager
def busy_model(url: str, model: str, request: Callable[[], Any]) -> Iterator[concurrent.futures.Future[Any]]:
    """``request`` sent in the background; entered once ``model``'s instance is computing it, which then takes a
    slow model's SLOW_DELAY_MS: what a test sends meanwhile meets a busy instance on any machine."""
    # Sent again when it was answered before a scrape saw it computing: a scrape of a long-lived server's metrics
    # (900 KB after the metrics tests) once took 0.46 s, about SLOW_DELAY_MS, and the one batch came and went unseen.
    deadline = time.monotonic() + 30
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(request)
        while metric_value(url, "visionserve_inflight_batches", model=model) < 1:
            assert time.monotonic() < deadline, f"{model}'s instance was never seen computing in 30 s"
            if future.done():
                future.result()  # its own failure, if it failed
                future = pool.submit(request)
            time.sleep(0.02)
        yield future


@pytest.fixture(scope="session")
def server(served_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    """The server of the API-semantics tests (routes, shapes, errors, parameters, metrics' names): the front end
    and its engine in this process, behind real HTTP (uvicorn as ``serve`` configures it), so tritonclient, KServe's
    client and httpx talk to it unchanged and a failure can be stepped through here. What is about processes
    (start, drain, kill, shared memory, overload) starts ``visionserve serve`` with :func:`start_server`."""
    settings = ServerSettings(
        repository=str(served_repo), port=0, grpc_port=0, admin_token=ADMIN_TOKEN, max_images_per_request=4,
        max_body_bytes=1024 * 1024, max_pixels=20_000_000, state_dir=str(tmp_path_factory.mktemp("state")),
    )  # fmt: skip
    if fast_models():
        _serve_noop(served_repo, ("digits",))
    with InProcessServer(settings) as running:
        yield running
