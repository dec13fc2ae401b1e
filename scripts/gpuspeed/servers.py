"""The servers ``make gpu-speed`` measures, pinned to the same cores: visionserve through the launcher, LitServe as
its app file; and the CPU each one's process tree used over a command (``/proc``, through the launcher's reader)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import httpx


def split_cores(cores: list[int], client_cores: int) -> tuple[list[int], list[int]]:
    """(load generator's, servers') cores: the first ``client_cores`` and the rest; on one core, both share it."""
    if len(cores) <= client_cores:
        return cores, cores
    return cores[:client_cores], cores[client_cores:]


def session_on(cpus: Collection[int]) -> Any:
    """A ``preexec_fn``: a session of its own (so the whole tree can be stopped) on ``cpus`` (as ``taskset -c``)."""
    chosen = set(cpus)

    def pin() -> None:
        os.setsid()
        os.sched_setaffinity(0, chosen)

    return pin


@contextlib.contextmanager
def litserve(cmd: list[str], *, cwd: Path, env: dict[str, str], cpus: Collection[int], log: Path, url: str,
             ready_timeout_s: float) -> Iterator[subprocess.Popen[bytes]]:  # fmt: skip
    """The LitServe app running until the block ends, once ``GET /health`` answers 200 (every worker loaded)."""
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=session_on(cpus))  # fmt: skip
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if proc.poll() is not None:
                tail = log.read_text(errors="replace")[-1500:]
                raise RuntimeError(f"LitServe exited {proc.returncode} before it was ready:\n{tail}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"LitServe was not ready in {ready_timeout_s:.0f} s: see {log}")
            time.sleep(0.2)
        yield proc
    finally:
        stop_group(proc)


def stop_group(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    """SIGTERM to the process's session, then SIGKILL to what is left of it (the launcher's one stop: nothing is
    sent to a process that had already ended, whose pid may be another's by now)."""
    from service.launcher import stop_process

    stop_process(proc, timeout_s=timeout_s, term_group=True)


class CpuUse:
    """The CPU a server's process tree used while one command ran: cores busy on average, and ms per answer."""

    def __init__(self, pid: int) -> None:
        from service.launcher import tree_cpu_s

        self.read = lambda: tree_cpu_s(pid)
        self.cpu0, self.t0 = self.read(), time.monotonic()

    def done(self, answers: int) -> dict[str, float]:
        cpu, wall = self.read() - self.cpu0, time.monotonic() - self.t0
        out = {"server_cpu_s": round(cpu, 2), "server_cores_busy": round(cpu / wall, 2) if wall else 0.0}
        if answers:
            out["server_cpu_ms_per_image"] = round(1000 * cpu / answers, 3)
        return out
