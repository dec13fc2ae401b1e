"""What the engine's and the detector's in-process figures share: a rate over a timed loop, and the pipeline that
decodes the next batch while the current one runs."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from service.runtime import RuntimeLike


def timed(seconds: float, step: Callable[[], int], min_rounds: int = 3) -> float:
    """Items per second of ``step`` (which returns how many items it did) over ``seconds`` (one warm-up round)."""
    step()
    done = rounds = 0
    started = time.perf_counter()
    while rounds < min_rounds or time.perf_counter() - started < seconds:
        done += step()
        rounds += 1
    return done / (time.perf_counter() - started)


class Pipeline:
    """The in-process limit without a batcher: ``decode`` (in a thread of its own) makes the next batch of ``size``
    of ``jpegs`` in turn while the current one runs."""

    def __init__(self, jpegs: list[bytes], size: int, runtime: RuntimeLike, decode: Callable[[list[bytes]], Any]):
        self._jpegs, self.size, self.runtime, self.decode = itertools.cycle(jpegs), size, runtime, decode
        self._decoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-decode")
        self._next = self._decoder.submit(self._decode_next)

    def _decode_next(self) -> Any:
        return self.decode(list(itertools.islice(self._jpegs, self.size)))

    def batch(self) -> Any:
        """The batch decoded last; the next one starts decoding."""
        batch, self._next = self._next.result(), self._decoder.submit(self._decode_next)
        return batch

    def __call__(self) -> int:
        return len(self.runtime.run(self.batch()))

    def close(self) -> None:
        self._decoder.shutdown(wait=True)
