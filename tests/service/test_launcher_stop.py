"""``launcher.stop_process``, the one way every server, script and benchmark stops a process it started: a process
that had ended before is sent nothing (its pid and group id may be another's by now), a live one is stopped with its
group, and one that ignores SIGTERM is killed past the timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

import pytest

from service import launcher

WAIT_S = 30.0  # for a process to start or end, however busy the machine


def sleeper(*, ignore_term: bool = False) -> subprocess.Popen[bytes]:
    """A Python process in a session of its own that prints one line once it is ready, then sleeps."""
    code = "import signal, sys, time\n"
    if ignore_term:
        code += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    code += "print('ready', flush=True)\ntime.sleep(600)\n"
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
    assert process.stdout is not None and process.stdout.readline() == b"ready\n"  # its handler is set
    return process


def test_a_process_that_had_ended_is_sent_no_signal(monkeypatch: pytest.MonkeyPatch) -> None:
    process = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    process.wait(WAIT_S)
    sent: list[Any] = []
    monkeypatch.setattr(os, "killpg", lambda *a: sent.append(("killpg", *a)))
    monkeypatch.setattr(os, "kill", lambda *a: sent.append(("kill", *a)))
    for term_group in (False, True):
        assert launcher.stop_process(process, term_group=term_group) == 0
    assert sent == []  # the reused-pid bug: a killpg here could reach whatever took the pid since


def test_a_live_process_is_stopped_with_its_group() -> None:
    process = sleeper()
    assert launcher.stop_process(process, timeout_s=WAIT_S, term_group=True) == -signal.SIGTERM
    with pytest.raises(ProcessLookupError):
        os.killpg(process.pid, 0)  # nothing of its group is left


def test_one_that_ignores_sigterm_is_killed_past_the_timeout() -> None:
    process = sleeper(ignore_term=True)
    assert launcher.stop_process(process, timeout_s=0.5) == -signal.SIGKILL
