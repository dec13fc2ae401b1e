"""Both ends of the transport on real sockets: pixels arrive intact, errors keep their kind, a gone engine answers
what was waiting with 503 at once, and every region is freed whatever the answer."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.core.errors import NotFoundError, OverloadedError
from service.transport import shm
from service.transport.client import EngineClient
from service.transport.messages import Catalog, ControlQuery, Failed, Result, Snapshot, Submit, Tensor, WireError
from service.transport.server import EngineEndpoint


class Handler:
    """Logits = each image's pixel sum; model "full" is refused as a 429; model "hold" is never answered."""

    def __init__(self, endpoint: EngineEndpoint) -> None:
        self.endpoint = endpoint

    def submit(self, peer: bytes, message: Submit, images: np.ndarray) -> None:
        if message.model == "full":
            self.endpoint.send(peer, Failed(message.id, WireError("OverloadedError", "queue full", 429)))
        elif message.model == "gone":
            self.endpoint.send(peer, Failed(message.id, WireError.of(NotFoundError("unknown model 'gone'"))))
        elif message.model != "hold":
            sums = images.reshape(len(images), -1).sum(axis=1, dtype=np.float32)[:, None]
            outputs = [Tensor.of("sums", sums)]
            self.endpoint.send(peer, Result(message.id, outputs, None, 0.001, 0.002, [len(images)]))

    def cancel(self, peer: bytes, request: int) -> None:
        pass

    async def query(self, peer: bytes, call: ControlQuery) -> Any:
        return Catalog([], {}, {}, 1)

    def catalog_version(self) -> int:
        return 1


@pytest.fixture
def arena_name() -> Iterator[str]:
    name = shm.new_name("rt")
    shm.create(name, 1 << 20).close()
    yield name
    shm.unlink(name)


async def connected(tmp: Path, arena: shm.Arena) -> tuple[EngineEndpoint, EngineClient]:
    address = f"ipc://{tmp}/engine"
    endpoint = EngineEndpoint(address, "test")
    await endpoint.start(Handler(endpoint))
    client = EngineClient(address, arena, "fe0", snapshot=lambda t: Snapshot(t, [], []), on_change=lambda: None)
    await client.start()
    async with asyncio.timeout(30):  # a bound in time, not a count of polls: a loaded machine connects late
        while not client.up:
            await asyncio.sleep(0.02)
    return endpoint, client


async def send(client: EngineClient, arena: shm.Arena, model: str, images: np.ndarray, guard_s: float = 5) -> Result:
    answer = await client.submit(model, 1, images, timeout_ms=None, priority=0, request_id="r", guard_s=guard_s)
    # when the answer was read off the socket: the front end's last stage starts there
    assert answer.answered >= answer.sent > 0
    return answer.result


def test_pixels_arrive_intact_and_errors_keep_their_kind(tmp_path: Path, arena_name: str) -> None:
    async def scenario() -> None:
        arena = shm.Arena(arena_name)
        endpoint, client = await connected(tmp_path, arena)
        images = np.random.default_rng(0).integers(0, 256, (3, 3, 8, 8), dtype=np.uint8)
        answers = await asyncio.gather(*(send(client, arena, "m", images) for _ in range(20)))
        expected = images.reshape(3, -1).sum(axis=1)
        for answer in answers:
            assert np.array_equal(answer.outputs[0].array(3), expected[:, None])
        with pytest.raises(OverloadedError) as refused:
            await send(client, arena, "full", images)
        assert (refused.value.http_status, refused.value.grpc_code) == (429, "RESOURCE_EXHAUSTED")
        with pytest.raises(NotFoundError, match="unknown model 'gone'"):
            await send(client, arena, "gone", images)
        assert arena.regions_in_use == 0 and arena.free_bytes == arena.size
        await client.close()
        await endpoint.close()
        arena.close()

    asyncio.run(scenario())


def test_a_gone_engine_answers_waiting_requests_with_503_and_frees_their_regions(
    tmp_path: Path, arena_name: str
) -> None:
    async def scenario() -> None:
        arena = shm.Arena(arena_name)
        endpoint, client = await connected(tmp_path, arena)
        images = np.zeros((1, 3, 8, 8), dtype=np.uint8)
        waiting = asyncio.ensure_future(send(client, arena, "hold", images, guard_s=30))
        await asyncio.sleep(0.1)
        assert arena.regions_in_use == 1
        loop = asyncio.get_running_loop()
        closed_at = loop.time()
        await endpoint.close()
        with pytest.raises(OverloadedError, match="not available"):
            await waiting
        assert loop.time() - closed_at < 2.0  # at once, not at the 30 s guard
        assert not client.up and arena.regions_in_use == 0
        with pytest.raises(OverloadedError):  # refused before anything is sent
            await send(client, arena, "m", images)
        assert arena.regions_in_use == 0
        await client.close()
        arena.close()

    asyncio.run(scenario())


def test_a_silent_engine_is_a_504_at_the_guard_and_the_region_stays_reserved(tmp_path: Path, arena_name: str) -> None:
    async def scenario() -> None:
        arena = shm.Arena(arena_name)
        endpoint, client = await connected(tmp_path, arena)
        from service.core.errors import DeadlineExceededError

        with pytest.raises(DeadlineExceededError):
            await send(client, arena, "hold", np.zeros((1, 3, 8, 8), dtype=np.uint8), guard_s=0.2)
        assert arena.regions_in_use == 1  # the engine may still read it: not reused until it answers or goes
        await client.close()
        await endpoint.close()
        arena.close()

    asyncio.run(scenario())
