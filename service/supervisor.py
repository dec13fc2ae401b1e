"""``visionserve serve``: the supervisor (README, "Processes"). One engine process per device (each GPU, or one for
the CPU) and N HTTP front-end processes sharing one listening socket, started, watched, restarted and drained here.

    supervisor   owns the listening socket, the shared-memory arenas and the ipc endpoints' folder
      engine     python -m service.engine.process      (binds ipc://<dir>/engine-<i> once warmed up)
      frontend   python -m service.frontend.server x N (HTTP on the inherited socket, its own arena)

If this process is killed outright, its children get SIGTERM from the kernel (PR_SET_PDEATHSIG) and a janitor
process (in a session of its own, so a kill of the whole process group spares it) unlinks the arenas. Children that
keep dying young are restarted with a growing delay (0.5 s doubling to 30 s), never in a tight loop.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from service.core.devices import gpu_count
from service.core.settings import ServerSettings
from service.engine.process import LAUNCH_ENV as ENGINE_ENV
from service.engine.process import EngineLaunch
from service.frontend.server import LAUNCH_ENV as FRONTEND_ENV
from service.frontend.server import FrontendLaunch
from service.transport import shm

log = logging.getLogger("visionserve.supervisor")

YOUNG_S = 5.0  # a child that dies younger than this is restarted after a growing delay
MAX_DELAY_S = 30.0


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_workers(cores: int | None = None) -> int:
    """Front ends for ``cores``: half the cores (the rest decode in threads and run the engine), 1 to 8."""
    cores = cores or cpu_count()
    return max(1, min(8, cores // 2))


class SupervisorOptions(msgspec.Struct, frozen=True, kw_only=True):
    workers: int = 0  # 0: default_workers()
    shm_mb: int = 64  # each front end's arena
    log_level: str = "warning"


@dataclass
class Child:
    kind: str  # "engine" or "frontend"
    name: str
    launch: Any
    process: subprocess.Popen[bytes] | None = None
    pidfd: int = -1
    started_at: float = 0.0
    failures: int = 0
    restart_at: float | None = None
    arena: str | None = None


class Supervisor:
    def __init__(self, settings: ServerSettings, options: SupervisorOptions | None = None) -> None:
        self.settings = settings
        self.options = options or SupervisorOptions()
        self.workers = self.options.workers or default_workers()
        self.children: list[Child] = []
        self.stopping = False
        self._selector = selectors.DefaultSelector()

    # ---- start --------------------------------------------------------------------------------------------------
    def run(self) -> int:
        # The janitor outlives us in a session of its own and unlinks our segments however we end.
        subprocess.Popen([sys.executable, "-m", "service.transport.janitor", str(os.getpid())],
                         start_new_session=True, stdin=subprocess.DEVNULL)  # fmt: skip
        self._dir = Path(tempfile.mkdtemp(prefix="visionserve-"))
        self._listener = self._listen()
        port = self._listener.getsockname()[1]
        gpus = gpu_count()
        engines = max(1, gpus)
        try:
            self._wake_r, self._wake_w = socket.socketpair()
            self._wake_r.setblocking(False)
            self._wake_w.setblocking(False)
            signal.set_wakeup_fd(self._wake_w.fileno())
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, self._on_signal)
            self._selector.register(self._wake_r, selectors.EVENT_READ, None)
            endpoints = []
            for i in range(engines):
                endpoint = f"ipc://{self._dir}/engine-{i}"
                endpoints.append(endpoint)
                engine = EngineLaunch(
                    settings=self.settings, name=f"engine{i}", endpoint=endpoint,
                    gpus=[f"cuda:{i}"] if gpus else None, primary=i == 0, log_level=self.options.log_level,
                )  # fmt: skip
                self._start(Child("engine", engine.name, engine))
            # The sources live in fe0 (docs/sources.md); with several front ends the others reach it on a Unix socket.
            owner = self._sources_socket() if self.workers > 1 else None
            for i in range(self.workers):
                launch = FrontendLaunch(
                    settings=self.settings, name=f"fe{i}", arena="", engines=tuple(endpoints),
                    fd=self._listener.fileno(), frontends=self.workers, log_level=self.options.log_level,
                    sources_fd=owner.fileno() if owner is not None and i == 0 else -1,
                    sources_socket=str(owner.getsockname()) if owner is not None else "",
                )  # fmt: skip
                self._start(Child("frontend", launch.name, launch))
            devices = ", ".join(f"cuda:{i}" for i in range(gpus)) if gpus else "cpu"
            print(
                f"visionserve: http://{self.settings.host}:{port} with {self.workers} front ends "
                f"(--workers; default from {cpu_count()} cores) and {engines} engine(s) ({devices})",
                flush=True,
            )
            self._watch()
        finally:
            self._shutdown()
        return 0

    def _listen(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.settings.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.settings.host, self.settings.port))
        sock.listen(2048)
        sock.set_inheritable(True)
        return sock

    def _sources_socket(self) -> socket.socket:
        """The Unix socket the sources' owner (fe0) listens on, for the other front ends; kept across its restarts."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(self._dir / "sources.sock"))
        sock.listen(256)
        sock.set_inheritable(True)
        self._owner_socket = sock
        return sock

    def _start(self, child: Child) -> None:
        if child.kind == "frontend":
            if child.arena:
                shm.unlink(child.arena)  # the old front end is gone; nothing reads its arena any more
            child.arena = shm.new_name(child.name)
            shm.create(child.arena, self.options.shm_mb * 1024 * 1024).close()
            child.launch = msgspec.structs.replace(child.launch, arena=child.arena)
            env_name, pass_fds = FRONTEND_ENV, [self._listener.fileno()]
            if child.launch.sources_fd >= 0:
                pass_fds.append(child.launch.sources_fd)
            module = "service.frontend.server"
        else:
            env_name, pass_fds, module = ENGINE_ENV, [], "service.engine.process"
        env = {**os.environ, env_name: msgspec.json.encode(child.launch).decode(), "PYTHONUNBUFFERED": "1"}
        child.process = subprocess.Popen(
            [sys.executable, "-m", module], env=env, pass_fds=pass_fds, start_new_session=True
        )
        child.pidfd = os.pidfd_open(child.process.pid)
        child.started_at = time.monotonic()
        child.restart_at = None
        self._selector.register(child.pidfd, selectors.EVENT_READ, child)
        if child not in self.children:
            self.children.append(child)
        log.info("started %s (pid %d)", child.name, child.process.pid)

    # ---- watch ------------------------------------------------------------------------------------------------
    def _on_signal(self, sig: int, frame: Any) -> None:
        if not self.stopping:
            self.stopping = True
            print(f"visionserve: signal {sig}: draining, then exiting", file=sys.stderr, flush=True)

    def _watch(self) -> None:
        while not self.stopping:
            pending = [c.restart_at for c in self.children if c.restart_at is not None]
            timeout = max(0.0, min(pending) - time.monotonic()) if pending else None
            for key, _ in self._selector.select(timeout):
                if key.data is None:  # a signal arrived: empty the wake-up socket
                    with contextlib.suppress(BlockingIOError):
                        while self._wake_r.recv(64):
                            pass
                    continue
                self._reap(key.data)
            now = time.monotonic()
            for child in self.children:
                if child.restart_at is not None and child.restart_at <= now and not self.stopping:
                    self._start(child)

    def _reap(self, child: Child) -> None:
        assert child.process is not None
        code = child.process.wait()
        self._selector.unregister(child.pidfd)
        os.close(child.pidfd)
        child.pidfd = -1
        if self.stopping:
            return
        lived = time.monotonic() - child.started_at
        child.failures = child.failures + 1 if lived < YOUNG_S else 0
        delay = min(MAX_DELAY_S, 0.5 * 2 ** (child.failures - 1)) if child.failures else 0.0
        print(
            f"visionserve: {child.name} (pid {child.process.pid}) exited with {code} after {lived:.1f} s; "
            f"restarting{f' in {delay:.1f} s' if delay else ''}",
            file=sys.stderr,
            flush=True,
        )
        child.restart_at = time.monotonic() + delay

    # ---- stop -------------------------------------------------------------------------------------------------
    def _shutdown(self) -> None:
        self.stopping = True
        self._listener.close()  # new connections are refused from now on, not left in a backlog nobody reads
        bound = self.settings.drain_timeout_s + 10.0
        for kind in ("frontend", "engine"):  # front ends first: they need the engines to answer what they hold
            group = [c for c in self.children if c.kind == kind and c.process is not None]
            for child in group:
                assert child.process is not None
                if child.process.poll() is None:
                    child.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + bound
            for child in group:
                assert child.process is not None
                try:
                    child.process.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.error("%s did not stop within %.0f s: killed", child.name, bound)
                    child.process.kill()
                    child.process.wait()
        for child in self.children:
            if child.arena:
                shm.unlink(child.arena)
            if child.pidfd >= 0:
                os.close(child.pidfd)
        shutil.rmtree(self._dir, ignore_errors=True)
        signal.set_wakeup_fd(-1)
        # Everything is drained and released: a signal repeated while the interpreter winds down (a process manager
        # insisting) must not turn the clean status it has earned into death by the signal. Ignored, not handled:
        # the interpreter puts Python-level handlers back to the default while it finalises (a SIGTERM every 10 ms
        # then killed it with -15 once in a CI run), but it leaves ignored signals ignored.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)


def serve(settings: ServerSettings, options: SupervisorOptions) -> int:
    return Supervisor(settings, options).run()
