"""Start ``visionserve serve`` as a child process, wait until it is ready, stop it: the one way to do it.

The tests, the scripts, ``tune``'s verification and the Ray replica all start servers through this module, so they
agree on what "ready" means: ``/v2/health/ready`` answering 200, which the server gives only once every front end
has reached every engine (a front end accepts connections only then). Nothing here reads the server's log to
decide; the log is kept for the reader.

    with launcher.start(repo, log=tmp / "server.log", workers=2) as server:
        httpx.post(server.url + "/v1/models/digits/classify", ...)
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

READY_PATH = "/v2/health/ready"
POLL_S = 0.05  # between readiness probes: start-up takes seconds, so this costs nothing and reacts at once


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (another process may take it before the server binds; the start fails)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (Linux ``/proc``; none elsewhere or once it is gone)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            found += [int(child) for child in task.read_text().split()]
    return found


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it, parents first."""
    found = [pid]
    for current in found:  # the list grows as it is walked: breadth first, parents first
        found += children(current)
    return found


def roles(pid: int) -> dict[str, list[int]]:
    """A supervisor's children by role: ``{"engine": [...], "frontend": [...]}`` (from their command lines)."""
    found: dict[str, list[int]] = {"engine": [], "frontend": []}
    for child in children(pid):
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"service.engine.process" in cmdline:
                found["engine"].append(child)
            elif b"service.frontend.server" in cmdline:
                found["frontend"].append(child)
    return found


def tree_cpu_s(pid: int) -> float:
    """CPU time (user + system, seconds) of ``pid`` and its live descendants: what a server used over a span is the
    difference of two reads (a process that exited in between takes its share with it)."""
    ticks = 0
    for member in process_tree(pid):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{member}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
    return ticks / os.sysconf("SC_CLK_TCK")


def tree_rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` and its live descendants, summed, in MiB (pages they share counted in each)."""
    kb = 0
    for member in process_tree(pid):
        with contextlib.suppress(OSError, IndexError, ValueError):
            status = Path(f"/proc/{member}/status").read_text()
            kb += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return kb / 1024


def serve_command(
    repository: str | Path, port: int, *extra: str, host: str = "127.0.0.1", python: str | None = None
) -> list[str]:
    """The ``visionserve serve`` command line for ``repository`` on ``host:port``, plus ``extra`` flags."""
    return [python or sys.executable, "-m", "service.cli", "serve", "--repository", str(repository),
            "--host", host, "--port", str(port), *extra]  # fmt: skip


@dataclass
class RunningServer:
    """A started server: its URL, its process (the supervisor, in a session of its own) and its log."""

    url: str
    process: subprocess.Popen[bytes]
    log: Path | None = None
    grpc_port: int | None = None
    command: list[str] = field(default_factory=list)
    own_group: bool = True  # started in a session of its own: stop() may kill the whole group

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def grpc_target(self) -> str:
        if self.grpc_port is None:
            raise RuntimeError("this server was started without gRPC (pass grpc_port=)")
        return f"127.0.0.1:{self.grpc_port}"

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kwargs.pop("timeout", 60), **kwargs)

    def roles(self) -> dict[str, list[int]]:
        """The supervisor's engines and front ends (see :func:`roles`)."""
        return roles(self.process.pid)

    def tail(self, chars: int = 3000) -> str:
        if self.log is None or not self.log.exists():
            return "(no log kept)"
        return self.log.read_text(errors="replace")[-chars:]

    def stop(self, timeout_s: float = 30.0) -> int:
        return stop(self, timeout_s)

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def launch(
    repository: str | Path,
    *extra: str,
    log: Path | None = None,
    port: int | None = None,
    grpc_port: int | None = None,
    workers: int | None = None,
    env: dict[str, str] | None = None,
    python: str | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> RunningServer:
    """Start a server without waiting for it. ``log``: where its output goes (None: this process's own output).
    ``grpc_port``: None leaves gRPC off, 0 picks a free port. ``env`` is added to this process's environment."""
    port = port or free_port()
    flags = list(extra)
    if grpc_port is not None:
        grpc_port = grpc_port or free_port()
        flags += ["--grpc-port", str(grpc_port)]
    elif not _has_flag(extra, "--grpc-port"):
        flags += ["--grpc-port", "0"]  # gRPC off unless asked for
    if workers is not None:
        flags += ["--workers", str(workers)]
    if not _has_flag(extra, "--log-level"):
        flags += ["--log-level", "info"]
    command = serve_command(repository, port, *flags, python=python)
    environment = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    out = open(log, "wb") if log is not None else None  # noqa: SIM115 (the child holds it; closed below)
    try:
        # A session of its own, so that stop() can kill the whole tree if the supervisor cannot stop it.
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT if out else None, env=environment,
            start_new_session=preexec_fn is None, preexec_fn=preexec_fn,
        )  # fmt: skip
    finally:
        if out is not None:
            out.close()
    return RunningServer(f"http://127.0.0.1:{port}", process, log, grpc_port, command, preexec_fn is None)


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def start(repository: str | Path, *extra: str, ready_timeout_s: float = 120.0, **options: Any) -> RunningServer:
    """Start a server (see :func:`launch`) and return once it is ready; stopped again if it is not."""
    server = launch(repository, *extra, **options)
    try:
        wait_ready(server, ready_timeout_s)
    except BaseException:
        stop(server, timeout_s=5)
        raise
    return server


def is_ready(url: str, timeout_s: float = 1.0) -> bool:
    """One probe of ``url``'s readiness."""
    try:
        return httpx.get(url + READY_PATH, timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def wait_ready(server: RunningServer, timeout_s: float = 120.0) -> None:
    """Until the server says it is ready; raises if its process exits first or ``timeout_s`` passes."""
    wait_until(server, lambda: is_ready(server.url), timeout_s, "ready")


def wait_until(server: RunningServer, probe: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Until ``probe()`` is true (polled every POLL_S), for a state other than readiness (a server held not ready
    on purpose that already answers); raises if the server's process exits first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _check_alive(server)
        if probe():
            return
        time.sleep(POLL_S)
    raise RuntimeError(f"the server at {server.url} was not {what} in {timeout_s:g} s:\n{server.tail()}")


async def wait_ready_async(server: RunningServer, client: httpx.AsyncClient, timeout_s: float = 120.0) -> None:
    """:func:`wait_ready` for an event loop (the Ray replica's)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _check_alive(server)
        with contextlib.suppress(httpx.HTTPError):
            if (await client.get(server.url + READY_PATH, timeout=2.0)).status_code == 200:
                return
        await asyncio.sleep(POLL_S * 5)
    raise TimeoutError(f"the server at {server.url} was not ready in {timeout_s:g} s")


def _check_alive(server: RunningServer) -> None:
    if server.process.poll() is not None:
        raise RuntimeError(f"the server exited with {server.process.returncode} before it was ready:\n{server.tail()}")


def stop(server: RunningServer, timeout_s: float = 30.0) -> int:
    """SIGTERM (the server drains, then exits), then the whole process group killed if it has not exited within
    ``timeout_s``; its exit status."""
    return stop_process(server.process, timeout_s=timeout_s, group=server.own_group)


def stop_process(
    process: subprocess.Popen[Any], *, timeout_s: float = 30.0, group: bool = True, term_group: bool = False
) -> int:
    """The one way to stop a process this code started: SIGTERM (to its whole process group with ``term_group``:
    a server whose workers each need the signal), SIGKILL past ``timeout_s``, then, with ``group`` (it leads a
    session of its own), SIGKILL to what is left of its group. Nothing is sent to a process that had ended before:
    its pid and group id may be another process's by now (9563c8c). Its exit status."""
    if process.poll() is not None:
        return int(process.returncode)
    if term_group:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGTERM)
    else:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    if group:  # children left by a leader that had to be killed (its group id is not reused while they live)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
    return int(process.returncode)


def stop_all(servers: Sequence[RunningServer], timeout_s: float = 10.0) -> list[RunningServer]:
    """Stop every server in ``servers`` that still runs; the ones that did."""
    left = [s for s in servers if s.process.poll() is None]
    for server in left:
        stop(server, timeout_s)
    return left
