"""The visionserve server a replica runs: one child process on a free 127.0.0.1 port, started through the command
line by :mod:`service.launcher`, watched through its v2 health routes, drained with SIGTERM.

Nothing here knows Ray, so a plain test can drive it.
"""

from __future__ import annotations

import logging

import httpx
import msgspec

from service.core.lifetime import die_with_parent
from service.core.repository import MODEL_NAME_ENV
from service.launcher import READY_PATH, RunningServer, launch, stop, wait_ready_async

log = logging.getLogger(__name__)


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


class ServerProcess:
    """``visionserve serve`` as a child process of this one, started, awaited and stopped by
    :mod:`service.launcher` (the one way every server is started)."""

    def __init__(self, options: ReplicaOptions) -> None:
        self.options = options
        self.server: RunningServer | None = None

    def _started(self) -> RunningServer:
        if self.server is None:
            raise RuntimeError("visionserve has not been started")
        return self.server

    @property
    def url(self) -> str:
        return self._started().url

    def start(self) -> None:
        """Start the server; its output goes where this process's goes (Ray keeps it in the replica's log)."""
        env = {MODEL_NAME_ENV: self.options.model_name} if self.options.model_name else None
        # The CLI's own log level unless server_args sets one (the launcher's default, info, is for log files).
        flags = ("--drain-timeout-s", str(self.options.drain_timeout_s), "--log-level", "warning",
                 *self.options.server_args)  # fmt: skip
        # ``ray.kill`` and a crashed node end the replica with SIGKILL, which runs no cleanup: the server dies with it
        # (else it would live on, holding its port, its memory and its GPU). preexec_fn is what Ray itself uses to tie
        # its workers' lives to the raylet's (ray._private.services).
        self.server = launch(
            self.options.repository, *flags, log=None, env=env, preexec_fn=die_with_parent,
            python=self.options.python, workers=1,
        )  # fmt: skip
        log.info("started visionserve (pid %d) on %s", self.server.process.pid, self.server.url)

    async def wait_ready(self, client: httpx.AsyncClient) -> None:
        """Return once ``/v2/health/ready`` answers 200; raise if the server exits or is not ready in time."""
        await wait_ready_async(self._started(), client, self.options.ready_timeout_s)

    async def check_ready(self, client: httpx.AsyncClient, timeout_s: float = 5.0) -> None:
        """Raise unless the server runs and says it is ready (its models loaded, not draining)."""
        if (code := self._started().process.poll()) is not None:
            raise RuntimeError(f"visionserve exited with {code}")
        response = await client.get(self.url + READY_PATH, timeout=timeout_s)
        if response.status_code != 200:
            raise RuntimeError(f"visionserve is not ready: {READY_PATH} answered {response.status_code}")

    def stop(self) -> int | None:
        """SIGTERM (the server drains, then exits), SIGKILL past the drain bound; the exit status."""
        return None if self.server is None else stop(self.server, self.options.drain_timeout_s + 5.0)
