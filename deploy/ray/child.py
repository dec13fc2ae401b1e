"""The visionserve server a replica runs: one child process on a free 127.0.0.1 port, started through the command
line, watched through its v2 health routes, drained with SIGTERM.

Nothing here knows Ray, so a plain test can drive it.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import msgspec

log = logging.getLogger(__name__)

MODEL_NAME_ENV = "VISIONSERVE_MODEL_NAME"  # read by the server's repository scan (service/core/repository.py)
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class ReplicaOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What each replica's server is started with: the ``args`` of the Ray Serve application (serve.yaml)."""

    repository: str
    """Model repository folder, on every node (a shared file system, or baked into the image)."""
    model_name: str | None = None
    """Set when ``repository`` is one model's folder (KServe's layout); names that model."""
    server_args: tuple[str, ...] = ()
    """More ``visionserve serve`` flags, e.g. ``["--max-images", "16"]``; host, port and workers are ours."""
    ready_timeout_s: float = 180.0
    """How long a new replica's server may take to load and warm its models before the replica fails."""
    drain_timeout_s: float = 10.0
    """How long the server may drain queued work after SIGTERM before it is killed."""
    python: str | None = None
    """The interpreter that runs the server (default: the replica's own), e.g. another virtual environment's."""

    def __post_init__(self) -> None:
        owned = {"--host", "--port", "--workers", "--repository"} & {a.split("=", 1)[0] for a in self.server_args}
        if owned:
            raise ValueError(f"server_args may not set {sorted(owned)}: the replica sets them")
        if self.ready_timeout_s <= 0 or self.drain_timeout_s < 0:
            raise ValueError(
                f"ready_timeout_s must be > 0 and drain_timeout_s >= 0, got {self.ready_timeout_s}, "
                f"{self.drain_timeout_s}"
            )


def free_port() -> int:
    """A port free on 127.0.0.1 now (another process may take it before the server binds; the start then fails)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM this process when the replica that started it dies.

    ``ray.kill`` and a crashed node end the replica with SIGKILL, which runs no cleanup; without this the server
    would live on, holding its port, its memory and its GPU.
    """
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


class ServerProcess:
    """``visionserve serve`` as a child process of this one."""

    def __init__(self, options: ReplicaOptions) -> None:
        self.options = options
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [
            options.python or sys.executable, "-m", "service.cli", "serve", "--repository", options.repository,
            "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
            "--drain-timeout-s", str(options.drain_timeout_s), *options.server_args,
        ]  # fmt: skip
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the server; its output goes where this process's goes (Ray keeps it in the replica's log)."""
        env = dict(os.environ)
        if self.options.model_name:
            env[MODEL_NAME_ENV] = self.options.model_name
        # preexec_fn is what Ray itself uses to tie its workers' lives to the raylet's (ray._private.services).
        self.process = subprocess.Popen(self.command, env=env, preexec_fn=_die_with_parent)
        log.info("started visionserve (pid %d) on %s", self.process.pid, self.url)

    @property
    def returncode(self) -> int | None:
        return None if self.process is None else self.process.poll()

    async def wait_ready(self, client: httpx.AsyncClient) -> None:
        """Return once ``/v2/health/ready`` answers 200; raise if the server exits or is not ready in time."""
        deadline = time.monotonic() + self.options.ready_timeout_s
        while time.monotonic() < deadline:
            if self.returncode is not None:
                raise RuntimeError(f"visionserve exited with {self.returncode} before it was ready (see its log)")
            try:
                if (await client.get(self.url + "/v2/health/ready", timeout=2.0)).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.25)
        raise TimeoutError(f"visionserve was not ready within {self.options.ready_timeout_s} s")

    async def check_ready(self, client: httpx.AsyncClient, timeout_s: float = 5.0) -> None:
        """Raise unless the server runs and says it is ready (its models loaded, not draining)."""
        if self.returncode is not None:
            raise RuntimeError(f"visionserve exited with {self.returncode}")
        response = await client.get(self.url + "/v2/health/ready", timeout=timeout_s)
        if response.status_code != 200:
            raise RuntimeError(f"visionserve is not ready: /v2/health/ready answered {response.status_code}")

    def stop(self) -> int | None:
        """SIGTERM (the server drains, then exits), SIGKILL past the drain bound; the exit status."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(self.options.drain_timeout_s + 5.0)
            except subprocess.TimeoutExpired:
                log.warning("visionserve (pid %d) did not exit after SIGTERM; killing it", self.process.pid)
                self.process.kill()
                self.process.wait()
        return self.process.returncode
