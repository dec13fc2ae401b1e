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
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from export.exporter import ExportRequest, export_model
from export.sources import from_architecture, from_checkpoint

ADMIN_TOKEN = "test-admin-token"
FAST_MODELS_ENV = "VISIONSERVE_TEST_FAST_MODELS"
# The slow models' fixed cost per batch: long enough that a 50 ms poll cannot miss a batch computing and that a
# burst of concurrent requests arrives well within one batch, short enough to keep the tests quick.
SLOW_DELAY_MS = 400.0
_STARTED: list[RunningServer] = []


def fast_models() -> bool:
    return os.environ.get(FAST_MODELS_ENV, "") not in ("", "0")


def slow_config(*, max_queue_size: int = 1024, queue_full_status: int = 503, delay_ms: float = SLOW_DELAY_MS) -> str:
    """config.toml of a model that is slow by construction: batches of one, each held ``delay_ms`` on the runtime's
    worker thread, whatever the hardware."""
    return (
        f"max_batch_size = 1\nmax_queue_delay_ms = 0\nmax_queue_size = {max_queue_size}\n"
        f"queue_full_status = {queue_full_status}\n[faults]\ndelay_ms = {delay_ms}\n"
    )


def _serve_noop(repo: Path, real_models: tuple[str, ...]) -> None:
    """Under the fast-model switch: every model of ``repo`` not in ``real_models`` gets ``backend = "noop"``."""
    for model in sorted(p for p in repo.iterdir() if p.is_dir() and p.name not in real_models):
        config = model / "config.toml"
        lines = config.read_text().splitlines() if config.exists() else []
        kept = [line for line in lines if not line.replace(" ", "").startswith("backend=")]
        config.write_text("\n".join(['backend = "noop"', *kept]) + "\n")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class RunningServer:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def client(self, **kw: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kw)  # type: ignore[arg-type]


def start_server(
    repo: Path,
    log: Path,
    *extra: str,
    ready_timeout_s: float = 120,
    real_models: tuple[str, ...] = ("digits",),
    port: int | None = None,
) -> RunningServer:
    """A server on a free port (or ``port``), ready; ``real_models``: kept real under the fast-model switch."""
    if fast_models():
        _serve_noop(repo, real_models)
    port = port or free_port()
    grpc = [] if "--grpc-port" in extra else ["--grpc-port", "0"]  # gRPC only where a test asks for it
    cmd = [sys.executable, "-m", "service.cli", "serve", "--repository", str(repo), "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "info", *grpc, *extra]  # fmt: skip
    with open(log, "wb") as out:
        # A session of its own, so that teardown can kill the whole tree if the supervisor cannot stop it.
        process = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    running = RunningServer(url, process, log)
    _STARTED.append(running)
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/v2/health/ready", timeout=1).status_code == 200 and _every_front_end_up(log):
                return running
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    stop_server(running, timeout_s=5)
    raise RuntimeError(f"server not ready in {ready_timeout_s} s:\n{log.read_text()[-3000:]}")


def _every_front_end_up(log: Path) -> bool:
    """Whether every front end has reached every engine (their log lines): readiness is per front end, and one
    answering 200 while another still waits for its engine left a request 503 on a machine where start-up ran in
    another order."""
    text = log.read_text(errors="replace")
    started = re.search(r"with (\d+) front ends .* and (\d+) engine", text)
    return started is not None and text.count(" is up: ") >= int(started[1]) * int(started[2])


def stop_server(server: RunningServer, timeout_s: float = 30) -> int:
    """SIGTERM, then the whole process group killed if it has not exited within ``timeout_s``; its exit code."""
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()
    with contextlib.suppress(ProcessLookupError, PermissionError):  # children left by a killed supervisor
        os.killpg(server.process.pid, signal.SIGKILL)
    return int(server.process.returncode)


def stop_leftover_servers(since: int = 0) -> list[RunningServer]:
    """Stop every server started (``_STARTED[since:]``) that still runs; the ones that did."""
    left = [s for s in _STARTED[since:] if s.process.poll() is None]
    for server in left:
        stop_server(server, timeout_s=10)
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
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(request)
        wait_for_metric(url, "visionserve_inflight_batches", 1, model=model)
        yield future


@pytest.fixture(scope="session")
def served_repo(digits_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """digits (trained), digits2 (a copy for load/unload), and ``slow`` and ``slow429``: a 224x224 model (initial
    weights) slow by its config (:func:`slow_config`) with a queue of 2, for overload and deadline tests."""
    root = tmp_path_factory.mktemp("served")
    digits = from_checkpoint(digits_checkpoint)
    export_model(digits.eager, digits.spec, ExportRequest(name="digits", repository=str(root), latency=False))
    shutil.copytree(root / "digits", root / "digits2")
    slow = from_architecture("smallcnn", input_size=224)
    export_model(
        slow.eager, slow.spec, ExportRequest(name="slow", repository=str(root), formats=("onnx",), latency=False)
    )
    (root / "slow" / "config.toml").write_text(slow_config(max_queue_size=2))
    shutil.copytree(root / "slow", root / "slow429")
    (root / "slow429" / "config.toml").write_text(slow_config(max_queue_size=2, queue_full_status=429))
    return root


@pytest.fixture(scope="session")
def server(served_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    log = tmp_path_factory.mktemp("logs") / "server.log"
    running = start_server(
        served_repo, log, "--admin-token", ADMIN_TOKEN, "--max-images", "4", "--max-body-mb", "1",
        "--max-pixels", "20000000",
    )  # fmt: skip
    yield running
    stop_server(running)
