"""A trained digits model exported as `visionserve export` writes it (ONNX and TorchScript, export's default
config.toml), once per session; each tune test works on a copy, since ``tune --write`` changes the repository.

``TuneProcess`` runs the real ``visionserve tune`` in a process session of its own, its stderr progress read line by
line on a thread (so a test can wait for a phase, bounded in time), and its candidate servers' working folder under
the test's own ``TMPDIR``: whatever it left running is found by that path and killed when the test ends.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tune_source_repo(digits_export: Path) -> Path:
    """The pristine repository (never modified: copy it with :func:`copy_repo`)."""
    return digits_export


def copy_repo(source: Path, folder: Path) -> Path:
    """A copy of ``source`` at ``folder``/repo."""
    return Path(shutil.copytree(source, folder / "repo"))


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains ``text`` (a test's unique temporary path)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if text.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
    return found


class TuneProcess:
    """``python -m service.cli tune ARGS`` running; a context manager that always leaves nothing running."""

    def __init__(self, args: list[str], folder: Path, env: dict[str, str] | None = None) -> None:
        self.work = folder / "work"  # TMPDIR: tune's candidate repositories and server logs go under it
        self.work.mkdir(parents=True)
        self.stdout_path = folder / "tune.stdout"
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        # COLUMNS: rich wraps its stderr lines at 80 columns when not on a terminal, splitting what a test reads.
        env = {**os.environ, "TMPDIR": str(self.work), "COLUMNS": "240", "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(self.stdout_path, "wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "service.cli", "tune", "--no-progress", *args],
                stdout=out, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
            )  # fmt: skip
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line.rstrip("\n"))
            self._queue.put(self.lines[-1])
        self._queue.put(None)

    @property
    def stderr(self) -> str:
        return "\n".join(self.lines)

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def wait_for_line(self, pattern: str, timeout_s: float) -> str:
        """The first stderr line (from here on) matching ``pattern``; fails if the process ends or time runs out."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r} in {timeout_s} s:\n{self.stderr}") from None
            if line is None:
                raise AssertionError(f"tune closed stderr ({self.process.poll()}) before {pattern!r}:\n{self.stderr}")
            if re.search(pattern, line):
                return line

    def interrupt(self) -> None:
        """Ctrl-C as a terminal sends it: SIGINT to the whole process group (the load generator's processes too)."""
        os.killpg(self.process.pid, signal.SIGINT)

    def wait(self, timeout_s: float) -> int:
        """The exit status, once it has exited (and its stderr is read to the end)."""
        try:
            code = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"tune still running after {timeout_s} s:\n{self.stderr}") from None
        self._reader.join(10)
        return code

    def __enter__(self) -> TuneProcess:
        return self

    def __exit__(self, *_: object) -> None:
        if self.process.poll() is None:  # interrupted first, so that it stops its own server and writes its report
            with contextlib.suppress(ProcessLookupError):
                self.interrupt()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        for pid in processes_mentioning(str(self.work)):  # a candidate server a killed tune could not stop
            for kill in (os.killpg, os.kill):  # its session (it leads one), or the process alone
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    kill(pid, signal.SIGKILL)
        self._reader.join(10)
