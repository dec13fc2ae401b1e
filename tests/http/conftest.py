"""A real server process on 127.0.0.1 and a free port, serving a repository built for the tests."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from export.exporter import ExportRequest, export_model
from export.sources import from_architecture, from_checkpoint

ADMIN_TOKEN = "test-admin-token"


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


def start_server(repo: Path, log: Path, *extra: str, ready_timeout_s: float = 120) -> RunningServer:
    port = free_port()
    grpc = [] if "--grpc-port" in extra else ["--grpc-port", "0"]  # gRPC only where a test asks for it
    cmd = [sys.executable, "-m", "service.cli", "serve", "--repository", str(repo), "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "info", *grpc, *extra]  # fmt: skip
    with open(log, "wb") as out:
        process = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/v2/health/ready", timeout=1).status_code == 200:
                return RunningServer(url, process, log)
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"server not ready in {ready_timeout_s} s:\n{log.read_text()[-3000:]}")


def stop_server(server: RunningServer, timeout_s: float = 30) -> int:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()
    return int(server.process.returncode)


@pytest.fixture(scope="session")
def served_repo(digits_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """digits (trained), digits2 (a copy for load/unload), and two slow resnet18s for overload tests."""
    root = tmp_path_factory.mktemp("served")
    digits = from_checkpoint(digits_checkpoint)
    export_model(digits.eager, digits.spec, ExportRequest(name="digits", repository=str(root), latency=False))
    shutil.copytree(root / "digits", root / "digits2")
    slow = from_architecture("resnet18")
    export_model(
        slow.eager, slow.spec, ExportRequest(name="slow", repository=str(root), formats=("onnx",), latency=False)
    )
    (root / "slow" / "config.toml").write_text("max_batch_size = 1\nmax_queue_size = 2\nmax_queue_delay_ms = 0\n")
    shutil.copytree(root / "slow", root / "slow429")
    (root / "slow429" / "config.toml").write_text(
        "max_batch_size = 1\nmax_queue_size = 2\nmax_queue_delay_ms = 0\nqueue_full_status = 429\n"
    )
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
