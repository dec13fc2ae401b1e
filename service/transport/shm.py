"""Shared-memory arenas: one per front end, created and unlinked by the supervisor, written by its front end,
read by the engines.

A front end carves a request's uint8 tensor out of its arena (:class:`Arena.allocate`), decodes straight into it,
sends the engine the offset and shape, and frees the region when the engine's answer arrives (never earlier: the
engine may still be reading it). The supervisor owns the names' lifetime: it creates each arena before its front
end starts and unlinks it when that front end exits or the server stops; if the supervisor itself is killed, the
standard library's resource tracker (a separate process) unlinks what it created.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import os
import secrets
from multiprocessing import resource_tracker, shared_memory

import numpy as np

from service.core.errors import OverloadedError, PayloadTooLargeError

ALIGN = 64  # bytes: every region starts on a cache line
PREFIX = "visionserve-"


def new_name(tag: str) -> str:
    """A fresh segment name, unique per supervisor and restart (/dev/shm/visionserve-<pid>-<tag>-<random>)."""
    return f"{PREFIX}{os.getpid()}-{tag}-{secrets.token_hex(3)}"


def create(name: str, size: int) -> shared_memory.SharedMemory:
    """Create a segment (the supervisor's job; its resource tracker unlinks it if the supervisor dies)."""
    return shared_memory.SharedMemory(name=name, create=True, size=size)


def attach(name: str) -> shared_memory.SharedMemory:
    """Map an existing segment without taking ownership: this process exiting must not unlink it (Python < 3.13
    registers attached segments with the resource tracker too, which would unlink them at exit)."""
    segment = shared_memory.SharedMemory(name=name, create=False)
    with contextlib.suppress(Exception):  # the tracker may not run here; nothing to undo then
        resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
    return segment


def unlink(name: str) -> None:
    """Remove a segment's name (its memory goes when the last mapping closes); missing is fine."""
    try:
        segment = shared_memory.SharedMemory(name=name, create=False)
    except FileNotFoundError:
        return
    try:
        segment.unlink()  # also unregisters it from this process's tracker
    finally:
        segment.close()


class Mapped:
    """A shared-memory segment mapped here, as one uint8 array sliced per request (cheap)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.segment = attach(name)
        self.size = self.segment.size
        assert self.segment.buf is not None
        self._bytes = np.frombuffer(self.segment.buf, dtype=np.uint8)

    def close(self) -> bool:
        """Unmap; False while views are still alive (try again later). Then the segment is let go as it is (the
        mapping goes with the process) so that its ``__del__`` does not print a BufferError traceback at exit."""
        if hasattr(self, "_bytes"):
            del self._bytes
        try:
            self.segment.close()
        except BufferError:
            self.segment._buf = None  # type: ignore[attr-defined]
            self.segment._mmap = None  # type: ignore[attr-defined]
            return False
        return True


class Arena(Mapped):
    """The front end's side: a first-fit allocator over its segment. Single-threaded (the event loop's)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._starts: list[int] = [0]  # free blocks, sorted by start
        self._sizes: dict[int, int] = {0: self.size}
        self._used: dict[int, int] = {}

    @property
    def free_bytes(self) -> int:
        return sum(self._sizes.values())

    def allocate(self, shape: tuple[int, ...]) -> tuple[int, np.ndarray]:
        """(offset, a writable uint8 view of ``shape``); refuses at once when no region fits."""
        need = math.prod(shape)
        size = max(ALIGN, -(-need // ALIGN) * ALIGN)
        if size > self.size:
            raise PayloadTooLargeError(
                f"a tensor of {need} bytes is larger than the front end's shared-memory arena ({self.size} bytes)"
            )
        for i, start in enumerate(self._starts):
            block = self._sizes[start]
            if block >= size:
                del self._sizes[start]
                if block > size:
                    self._starts[i] = start + size
                    self._sizes[start + size] = block - size
                else:
                    del self._starts[i]
                self._used[start] = size
                return start, self._bytes[start : start + need].reshape(shape)
        raise OverloadedError(
            f"no free shared-memory slot ({self.free_bytes} of {self.size} bytes free, {need} needed)"
        )

    def free(self, offset: int) -> None:
        size = self._used.pop(offset)
        i = bisect.bisect_left(self._starts, offset)
        # merge with the next free block
        if i < len(self._starts) and self._starts[i] == offset + size:
            size += self._sizes.pop(self._starts[i])
            del self._starts[i]
        # merge with the previous free block
        if i > 0 and self._starts[i - 1] + self._sizes[self._starts[i - 1]] == offset:
            self._sizes[self._starts[i - 1]] += size
            return
        self._starts.insert(i, offset)
        self._sizes[offset] = size

    @property
    def regions_in_use(self) -> int:
        return len(self._used)


class ArenaReader(Mapped):
    """The engine's side: read-only views into a front end's segment."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._bytes.flags.writeable = False  # the engine only reads what front ends wrote

    def view(self, offset: int, shape: tuple[int, ...]) -> np.ndarray:
        need = math.prod(shape)
        if offset < 0 or offset + need > self.size or min(shape) < 1:
            raise ValueError(f"region {offset}+{need} {shape} is outside arena {self.name} ({self.size} bytes)")
        return self._bytes[offset : offset + need].reshape(shape)
