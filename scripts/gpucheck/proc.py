"""Running one command of the check: its output kept in a log, also what a command stopped at its deadline printed
until then (a killed export's last gate, a killed test run's last test)."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
from collections.abc import Callable, Collection, Mapping
from pathlib import Path


class StepError(Exception):
    """A step that failed; its message goes into the report."""


def pin_to(cpus: Collection[int] | None) -> Callable[[], None] | None:
    """A ``preexec_fn`` that runs the child on ``cpus`` (what ``taskset -c`` does; inherited by its children)."""
    if not cpus:
        return None
    chosen = set(cpus)
    return lambda: os.sched_setaffinity(0, chosen)


def run_logged(
    cmd: list[str],
    *,
    cwd: Path,
    env: Mapping[str, str],
    timeout_s: float,
    log: Path,
    cpus: Collection[int] | None = None,
) -> tuple[int | None, str, str]:
    """Run ``cmd`` in a session of its own (on ``cpus`` when given), killed with its children after ``timeout_s``;
    (exit code, or None when stopped; stdout; stderr), both written to ``log`` either way."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err, text=True, start_new_session=True,
                                preexec_fn=pin_to(cpus))  # fmt: skip
        try:
            code: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own children too (a server, compile workers)
            proc.wait()
            code = None
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    ended = "" if code is not None else f"(stopped after {timeout_s:.0f} s: above is what it printed until then)\n"
    log.write_text(f"$ {' '.join(cmd)}\n{stdout}\n--- stderr\n{stderr}{ended}")
    return code, stdout, stderr
