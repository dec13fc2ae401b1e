"""The front end's one view of an engine: :class:`EngineLink`, with two sides, which pass the same contract test
(``tests/transport/test_link_contract.py``): shared memory (:class:`SharedMemoryLinks`, what ``visionserve serve``
runs: the pixels go into this front end's arena and a small message to each engine process), and in process
(``service.inprocess``, above both rooms: the same messages handed over as objects on this event loop, so a request
can be stepped through in one process).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from service.transport.client import ControlCalls, EngineClient
from service.transport.messages import Answer, Catalog, Snapshot
from service.transport.shm import Arena


class EngineLink(ControlCalls, Protocol):
    """One engine, seen from a front end, with its control calls (:class:`ControlCalls`, one typed method per
    query). All methods run on the front end's event loop."""

    up: bool  # connected, and has said what it serves
    catalog: Catalog | None  # what it serves (None until it has said)
    frontends: int  # how many front ends have reached it

    @property
    def inflight(self) -> int: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def submit(
        self,
        model: str,
        version: int,
        images: np.ndarray | list[np.ndarray],
        *,
        timeout_ms: float | None,
        priority: int,
        request_id: str,
        guard_s: float,
        route: str | None = None,
    ) -> Answer: ...

    async def refresh(self) -> None: ...


class LinkOwner(Protocol):
    """What a link reports to: the front end's state."""

    frontend: str

    def snapshot(self, token: int) -> Snapshot: ...

    def catalog_changed(self) -> None: ...


class Linker(Protocol):
    """Builds a front end's links once its event loop runs (the state starts and closes each link), and releases
    what they shared after them."""

    def connect(self, owner: LinkOwner) -> list[EngineLink]: ...

    def close(self) -> None: ...


class SharedMemoryLinks:
    """The :class:`Linker` of a front end started by the supervisor: its arena and an :class:`EngineClient` per
    engine endpoint."""

    def __init__(self, arena: str, endpoints: tuple[str, ...]) -> None:
        if not arena or not endpoints:
            raise RuntimeError("a front end needs an arena and an engine endpoint (start it with `visionserve serve`)")
        self.arena_name = arena
        self.endpoints = endpoints
        self.arena: Arena | None = None

    def connect(self, owner: LinkOwner) -> list[EngineLink]:
        self.arena = arena = Arena(self.arena_name)
        return [
            EngineClient(e, arena, owner.frontend, snapshot=owner.snapshot, on_change=owner.catalog_changed)
            for e in self.endpoints
        ]

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()
            self.arena = None
