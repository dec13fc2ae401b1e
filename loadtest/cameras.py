"""Simulated cameras for the tests and ``visionserve bench sources``: loadtest/rtsp_server.py (GStreamer's RTSP
server, run by Debian's Python, which has PyGObject) as a child process on 127.0.0.1, and whether it can run here.
Only the standard library: the camera is a separate program, this is its handle.

    if rtsp_available() is None:
        with RtspServer(mounts=2) as rtsp:
            av.open(rtsp.url(1), options={"rtsp_transport": "tcp"})
"""

from __future__ import annotations

import contextlib
import functools
import os
import select
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Self

__all__ = ["CANNOT_LISTEN", "HOST", "RTSP_CHECK", "RTSP_SCRIPT", "SYSTEM_PYTHON", "RtspServer", "rtsp_available"]

HOST = "127.0.0.1"
SYSTEM_PYTHON = "/usr/bin/python3"
RTSP_SCRIPT = Path(__file__).resolve().with_name("rtsp_server.py")
CANNOT_LISTEN = 3  # rtsp_server.py's exit status when its port is taken
# What rtsp_server.py needs from Debian: PyGObject, gst-rtsp-server's bindings and the elements of its pipeline
# (x264enc is in gstreamer1.0-plugins-ugly, rtph264pay in -good, videotestsrc in -base).
RTSP_CHECK = (
    "import gi; gi.require_version('Gst', '1.0'); gi.require_version('GstRtspServer', '1.0'); "
    "from gi.repository import Gst, GstRtspServer; Gst.init(None); "
    "missing = [e for e in ('videotestsrc', 'x264enc', 'rtph264pay') if Gst.ElementFactory.find(e) is None]; "
    "assert not missing, 'missing GStreamer elements: ' + ', '.join(missing)"
)


@functools.cache
def rtsp_available() -> str | None:
    """None when Debian's Python can run loadtest/rtsp_server.py (PyGObject, gst-rtsp-server and the
    pipeline's elements are installed), else why not."""
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        return f"{SYSTEM_PYTHON} is missing (scripts/install-video.sh)"
    try:
        done = subprocess.run(
            [SYSTEM_PYTHON, "-c", RTSP_CHECK], capture_output=True, text=True, timeout=60, env=_system_env()
        )
    except subprocess.TimeoutExpired:
        return "checking GStreamer under /usr/bin/python3 took over 60 s"
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines() or [f"exit status {done.returncode}"]
        return f"GStreamer's RTSP server is not usable from {SYSTEM_PYTHON}: {lines[-1]} (scripts/install-video.sh)"
    return None


def _system_env() -> dict[str, str]:
    """The environment for Debian's Python: without the virtual environment's Python settings."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


@dataclass(kw_only=True, eq=False)
class RtspServer:
    """loadtest/rtsp_server.py as a child process: ``start()`` waits for it to listen, ``url(mount)`` names a
    stream, ``kill()`` ends it as a crash would, ``restart()`` brings it back on the same port, ``stop()`` ends it
    cleanly. A context manager; the child also exits when this process does (it watches its stdin)."""

    port: int = 0
    mounts: int = 1
    width: int = 640
    height: int = 480
    fps: int = 15
    keyint: int = 15
    bitrate_kbps: int = 500
    ready_timeout_s: float = 30.0
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)
    _stderr: IO[bytes] | None = field(default=None, init=False, repr=False)

    @property
    def pid(self) -> int:
        if self.process is None:
            raise RuntimeError("the RTSP server is not running")
        return self.process.pid

    def url(self, mount: int = 0) -> str:
        if not self.port:
            raise RuntimeError("the RTSP server has not been started")
        if not 0 <= mount < self.mounts:
            raise ValueError(f"mount must be in 0..{self.mounts - 1}, got {mount}")
        return f"rtsp://{HOST}:{self.port}/cam{mount}"

    def command(self) -> list[str]:
        return [
            SYSTEM_PYTHON, str(RTSP_SCRIPT), "--port", str(self.port), "--mounts", str(self.mounts),
            "--width", str(self.width), "--height", str(self.height), "--fps", str(self.fps),
            "--keyint", str(self.keyint), "--bitrate", str(self.bitrate_kbps), "--watch-stdin",
        ]  # fmt: skip

    def start(self) -> Self:
        """Starts the server and returns once it listens; raises RuntimeError (with its stderr) if it exits first
        or is not listening within ``ready_timeout_s``."""
        if self.process is not None:
            raise RuntimeError("the RTSP server is already running")
        self._try_start()
        return self

    def restart(self, timeout_s: float = 10.0) -> Self:
        """Starts the server again on the port it had (after :meth:`kill` or :meth:`stop`), trying again for up to
        ``timeout_s`` while the port is not free yet."""
        if not self.port:
            raise RuntimeError("the RTSP server has never been started: there is no port to restart on")
        self.stop()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._try_start()
                return self
            except _PortTaken as exc:
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"port {self.port} still taken {timeout_s} s after the restart began") from exc
                time.sleep(0.1)  # the kernel frees the port on its own schedule; nothing to wait on

    def kill(self) -> None:
        """SIGKILL, as a crash: clients see their connections reset. Waits until the process is gone."""
        if self.process is not None:
            self.process.kill()
            self._reap()

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM and wait (SIGKILL after ``timeout_s``). Nothing happens if it is not running."""
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self._reap()

    def stderr(self) -> str:
        """What the current (or last) process wrote on stderr."""
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def _try_start(self) -> None:
        if self._stderr is not None:
            self._stderr.close()
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 (kept open while the process lives, read on failure)
        process = subprocess.Popen(
            self.command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, env=_system_env()
        )
        self.process = process
        assert process.stdout is not None
        line, ended = self._read_line(process.stdout.fileno())
        if line.startswith(b"READY "):
            self.port = int(line.split()[1])
            return
        code: int | None = None
        if ended:  # stdout closed: the process is exiting (it may not be reaped yet)
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = process.wait(10.0)
        if code is None:
            self.kill()
        else:
            self._reap()
        if code == CANNOT_LISTEN and self.port:
            raise _PortTaken(self.stderr())
        what = f"exited with status {code}" if code is not None else f"was not ready in {self.ready_timeout_s} s"
        raise RuntimeError(f"the RTSP server {what}; stdout: {line!r}; stderr:\n{self.stderr()[-3000:]}")

    def _read_line(self, fd: int) -> tuple[bytes, bool]:
        """The first line on stdout (or what came before the deadline), and whether stdout ended first."""
        deadline = time.monotonic() + self.ready_timeout_s
        line = b""
        while b"\n" not in line:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            readable, _, _ = select.select([fd], [], [], remaining)
            if readable:
                chunk = os.read(fd, 256)
                if not chunk:
                    return line.strip(), True
                line += chunk
        return line.split(b"\n", 1)[0].strip(), False

    def _reap(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        process.wait()
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                pipe.close()


class _PortTaken(RuntimeError):
    """rtsp_server.py could not listen on the port it was given."""
