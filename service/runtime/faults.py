"""Faults injected into a real runtime on its own worker thread, from a model's ``[faults]`` table (README,
"Reliability", fire drills): the reliability tests and drills wedge or break a real model the way a driver bug or a
bad kernel would, with the rest of the server unchanged.

One plan is shared by every instance of a model version (and by the instances that replace them), so "the sixth
batch hangs" means the sixth batch the model ran, whichever instance ran it.
"""

from __future__ import annotations

import threading
import time

from service.core.config import Faults
from service.core.errors import RuntimeFailure


class FaultPlan:
    """Counts batches and decides, on the worker thread, whether this one is delayed, hangs or fails."""

    def __init__(self, faults: Faults) -> None:
        self.faults = faults
        self._lock = threading.Lock()
        self._batches = 0
        self._released = threading.Event()

    @staticmethod
    def wanted(faults: Faults) -> bool:
        delays = faults.delay_ms > 0 or faults.image_delay_ms > 0 or faults.load_delay_ms > 0
        return delays or faults.hang_at_batch >= 0 or faults.fail_after_batches >= 0 or bool(faults.load_error)

    def before_load(self) -> None:
        """Called before an instance loads (at start-up, and for a replacement)."""
        if self.faults.load_delay_ms > 0:
            time.sleep(self.faults.load_delay_ms / 1000.0)
        if self.faults.load_error:
            # Not the project's own error: what a runtime's library raises that nobody translated (an import error,
            # a driver's exception), which the engine must still report rather than lose.
            raise RuntimeError(f"injected load failure: {self.faults.load_error}")

    def before_batch(self, images: int = 1) -> None:
        """Called on a runtime's worker thread before its forward of ``images`` images."""
        with self._lock:
            number = self._batches
            self._batches += 1
        faults = self.faults
        if faults.delay_ms > 0 or faults.image_delay_ms > 0:
            time.sleep((faults.delay_ms + faults.image_delay_ms * images) / 1000.0)
        if number == faults.hang_at_batch:
            # Wedged until the server shuts down (a real hang would not even wake then: the engine must not need
            # this thread back to replace the instance or to exit).
            self._released.wait()
            raise RuntimeFailure("injected hang released at shutdown")
        if 0 <= faults.fail_after_batches <= number:
            raise RuntimeFailure(f"injected fault: batch {number} fails (faults.fail_after_batches)")

    def release(self) -> None:
        """Wake the hung batch, if any (when the model shuts down: abandoning a stuck instance does not, just as
        nothing could wake a real hang)."""
        self._released.set()
