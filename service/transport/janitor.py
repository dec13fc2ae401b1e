"""``python -m service.transport.janitor PID``: waits for the supervisor ``PID`` to exit, however it exits, then
unlinks every shared-memory segment it named (``/dev/shm/visionserve-PID-*``).

The supervisor starts it in a session of its own, so that even a kill of the supervisor's whole process group (a
container runtime, or a cluster tearing its workers down) leaves no segment behind; the standard library's resource
tracker, the other safety net, sits in the supervisor's group and dies with it.
"""

from __future__ import annotations

import os
import select
import sys
from pathlib import Path

from service.transport.shm import PREFIX


def main(argv: list[str] | None = None) -> int:
    pid = int((sys.argv[1:] if argv is None else argv)[0])
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        fd = -1  # already gone: clean up at once
    if fd >= 0:
        select.select([fd], [], [])
        os.close(fd)
    for segment in Path("/dev/shm").glob(f"{PREFIX}{pid}-*"):
        segment.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
