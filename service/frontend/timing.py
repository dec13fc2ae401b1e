"""Where one request's time went: the stamps a front end takes, and the stages they make."""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field

from service.core.metrics import NOT_OBSERVED, STAGES
from service.transport.messages import Stamps


@dataclass
class Timing:
    """Where one request's time went (Server-Timing, the access log and the stage histograms).

    The durations (``preprocess_s``, ``queue_s``, ``compute_s``, ``postprocess_s``) are what the first metrics
    reported. The stamps are ``time.perf_counter()`` seconds, which on Linux is CLOCK_MONOTONIC, the clock the engine
    stamps with too (``time.monotonic()``): one clock for the whole machine, so stamps taken in the engine process
    line up with the front end's. :meth:`stages` turns them into :data:`STAGES`, contiguous, summing to the total.
    """

    preprocess_s: float = 0.0
    queue_s: float = 0.0
    compute_s: float = 0.0
    postprocess_s: float = 0.0
    cold_start_s: float = 0.0  # waited in the engine for the model's load (on demand): part of to_engine's stage
    arrived: float = field(default_factory=time.perf_counter)  # the request's first byte seen by the server
    read: float = NOT_OBSERVED  # its body read
    decode_start: float = NOT_OBSERVED  # the first decode thread took an image
    decode_end: float = NOT_OBSERVED  # the last image decoded
    sent: float = NOT_OBSERVED  # the message to the engine sent (the pixels in shared memory)
    engine: Stamps | None = None  # the engine's stamps of the answer (the last batch, for a split request)
    version: int = 0  # the version that answered, as the engine says (a canary's candidate); 0: the one asked
    answered: float = NOT_OBSERVED  # the answer read off the transport by this front end
    detections: list[int] | None = None  # a detector's detections per image (visionserve_detections_per_image)

    def mark_read(self) -> None:
        if math.isnan(self.read):
            self.read = time.perf_counter()

    def stages(self, end: float) -> tuple[float, ...] | None:
        """The :data:`STAGES` durations (seconds) of a request answered by the engine, ending at ``end``; None for
        one that never got an answer. Each stage runs from the previous one's end, so they sum to ``end -
        arrived``; a stamp a request has no use for (no decoding for a tensor body) makes its stage zero."""
        e = self.engine
        if e is None or math.isnan(self.answered) or math.isnan(self.sent):
            return None
        read = self.read if not math.isnan(self.read) else self.arrived
        decode_start = self.decode_start if not math.isnan(self.decode_start) else read
        decode_end = self.decode_end if not math.isnan(self.decode_end) else decode_start
        # Clamped in order: a stamp that precedes the one before it (threads racing the loop by microseconds)
        # gives a zero stage rather than a negative one, and the sum still ends where it should.
        points = [self.arrived, read, decode_start, decode_end, self.sent, e.received,
                  max(e.instance, e.received), e.batch, e.done, self.answered, end]  # fmt: skip
        return tuple(b - a for a, b in itertools.pairwise(itertools.accumulate(points, max)))

    def header(self, total_s: float | None = None) -> str:
        stages = self.stages(self.arrived + total_s) if total_s is not None else None
        parts = [f"queue;dur={self.queue_s * 1000:.3f}", f"preprocess;dur={self.preprocess_s * 1000:.3f}"]
        if stages is None:
            parts.append(f"compute;dur={self.compute_s * 1000:.3f}")
        parts.append(f"postprocess;dur={self.postprocess_s * 1000:.3f}")
        if stages is not None:  # every stage by name (its "compute" in place of the batcher's own, nearly equal)
            parts += [f"{name};dur={s * 1000:.3f}" for name, s in zip(STAGES, stages, strict=True)]
        if self.cold_start_s:
            parts.append(f"cold_start;dur={self.cold_start_s * 1000:.3f}")
        if total_s is not None:
            parts.append(f"total;dur={total_s * 1000:.3f}")
        return ", ".join(parts)
