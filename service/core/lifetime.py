"""Child processes' ties to the supervisor that started them."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys


def die_with_parent() -> None:
    """Linux: get SIGTERM when the supervisor (or a Ray replica) dies, however it dies, so no child outlives it."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the supervisor's own exit path still stops us
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the supervisor is already gone
        sys.exit(0)
