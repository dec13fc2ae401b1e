"""The engine link's contract, held by both sides: the shared-memory link (a real engine endpoint on an ipc socket,
a real arena) and the in-process link, each driving a real :class:`EngineServer` over the trained digits model.

What a front end relies on: the link comes up with the engine's catalog and says how many front ends reached it;
a batch computes to the engine's logits (as a list of images too); an unknown model or version is the engine's own
404, a full queue its 503 or 429, a bad query a 400, each raised as the project's exception; a cancelled request is
dropped; the stats and metrics queries answer in the shapes the front end merges.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from service.core.errors import BadInputError, DeadlineExceededError, NotFoundError, OverloadedError
from service.core.settings import ServerSettings
from service.engine.server import EngineServer
from service.frontend.link import EngineLink, SharedMemoryLinks
from service.inprocess import InProcessEngine
from service.transport import shm
from service.transport.messages import Snapshot
from service.transport.server import EngineEndpoint
from tests.http.conftest import slow_config


class Owner:
    """A front end's state, as little as a link needs."""

    frontend = "fe0"

    def __init__(self) -> None:
        self.changes = 0
        self.regions: Callable[[], int] | None = None  # shared-memory regions the link holds (that side only)

    def snapshot(self, token: int) -> Snapshot:
        return Snapshot(token, [], [])

    def catalog_changed(self) -> None:
        self.changes += 1


@pytest.fixture(scope="module")
def repo(served_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("link-repo")
    shutil.copytree(served_repo / "digits", root / "digits")
    shutil.copytree(served_repo / "slow", root / "slow")
    (root / "slow" / "config.toml").write_text(slow_config(max_queue_size=1, queue_full_status=429, delay_ms=300))
    return root


@asynccontextmanager
async def shared_memory_link(settings: ServerSettings, tmp: Path) -> AsyncIterator[tuple[EngineLink, Owner]]:
    """An engine endpoint on a real ipc socket, and a front end's link to it through a real arena."""
    address = f"ipc://{tmp}/engine-0"
    endpoint = EngineEndpoint(address, "engine0")
    engine = EngineServer(settings, endpoint)
    await engine.load_all()
    await endpoint.start(engine)
    arena = shm.new_name("contract")
    shm.create(arena, 16 << 20).close()
    linker = SharedMemoryLinks(arena, (address,))
    owner = Owner()
    (link,) = linker.connect(owner)
    owner.regions = lambda: linker.arena.regions_in_use if linker.arena is not None else -1
    await link.start()
    try:
        yield link, owner
    finally:
        await link.close()
        linker.close()
        await engine.drain()
        await endpoint.close()
        shm.unlink(arena)


@asynccontextmanager
async def in_process_link(settings: ServerSettings, tmp: Path) -> AsyncIterator[tuple[EngineLink, Owner]]:
    linker = InProcessEngine(settings)
    owner = Owner()
    (link,) = linker.connect(owner)
    await link.start()
    try:
        yield link, owner
    finally:
        await link.close()
        linker.close()


SIDES: dict[str, Callable[[ServerSettings, Path], Any]] = {
    "shared-memory": shared_memory_link,
    "in-process": in_process_link,
}


async def until(check: Callable[[], bool], timeout_s: float = 30.0) -> None:
    async with asyncio.timeout(timeout_s):  # bounded in time: a loaded machine connects late
        while not check():
            await asyncio.sleep(0.01)


async def slow_metrics(link: EngineLink) -> dict[str, float]:
    """The engine's batches counted, in flight and images queued for model ``slow``."""
    text = (await link.metrics()).decode()
    out = {"visionserve_batches_total": 0.0, "visionserve_inflight_batches": 0.0, "visionserve_queue_depth": 0.0}
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name in out and 'model="slow"' in line:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


async def until_slow(link: EngineLink, check: Callable[[dict[str, float]], bool], timeout_s: float = 30.0) -> None:
    """Until ``check`` holds of :func:`slow_metrics` (the engine's own view), bounded in time."""
    async with asyncio.timeout(timeout_s):
        while not check(await slow_metrics(link)):
            await asyncio.sleep(0.01)


def submit(link: EngineLink, model: str, images: Any, version: int = 1, **kw: Any) -> Any:
    return link.submit(model, version, images, timeout_ms=None, priority=0, request_id="r", guard_s=30, **kw)


@pytest.mark.parametrize("side", sorted(SIDES))
def test_the_link_contract(side: str, repo: Path, tmp_path: Path) -> None:
    settings = ServerSettings(repository=str(repo), grpc_port=0)

    async def scenario() -> None:
        async with SIDES[side](settings, tmp_path) as (link, owner):
            await until(lambda: link.up and link.frontends >= 1)
            assert link.catalog is not None and owner.changes >= 1
            assert sorted({m.model for m in link.catalog.models}) == ["digits", "slow"]

            images = np.random.default_rng(0).integers(0, 256, (3, 1, 28, 28), dtype=np.uint8)
            answer = await submit(link, "digits", images)
            (tensor,) = answer.result.outputs
            logits = tensor.array(3)
            assert (tensor.name, tensor.dtype, tensor.shape) == ("logits", "float32", (10,))
            assert np.isfinite(logits).all()
            assert answer.answered >= answer.sent > 0
            as_list = await submit(link, "digits", list(images))  # stacked by the link, same answer
            assert np.allclose(as_list.result.outputs[0].array(3), logits)

            with pytest.raises(NotFoundError, match="unknown model 'nope'"):
                await submit(link, "nope", images)
            with pytest.raises(NotFoundError, match="no version 7"):
                await submit(link, "digits", images, version=7)

            one = np.zeros((1, 3, 224, 224), dtype=np.uint8)
            first = asyncio.ensure_future(submit(link, "slow", one))  # computing for 300 ms
            # The engine's batch computes (not merely `first` sent: the queue's place would still be taken by it).
            await until_slow(link, lambda m: m["visionserve_inflight_batches"] >= 1)
            queued = asyncio.ensure_future(submit(link, "slow", one))  # the queue's one place
            await until_slow(link, lambda m: m["visionserve_queue_depth"] >= 1)  # taken, while `first` computes
            with pytest.raises(OverloadedError) as full:
                await submit(link, "slow", one)
            assert full.value.http_status == 429  # the model's queue_full_status rides on the error
            queued.cancel()  # the client went away: dropped before compute
            with pytest.raises(asyncio.CancelledError):
                await queued
            if owner.regions is not None:  # the engine says it dropped it: its region is free while `first` computes
                await until(lambda: owner.regions() == 1)
            await first
            if owner.regions is not None:
                assert owner.regions() == 0

            # A request cancelled while its batch computes: the engine reads its pixels until the batch is done (a
            # failed batch is retried image by image), so its region is freed then, not at the cancel, nor never.
            computing = asyncio.ensure_future(submit(link, "slow", one))
            await until_slow(link, lambda m: m["visionserve_inflight_batches"] >= 1)  # its 300 ms batch runs
            batches = (await slow_metrics(link))["visionserve_batches_total"]
            computing.cancel()
            with pytest.raises(asyncio.CancelledError):
                await computing
            if owner.regions is not None:
                await until(lambda: owner.regions() == 0, timeout_s=10)
                assert (await slow_metrics(link))["visionserve_batches_total"] == batches + 1  # freed after it

            # A deadline that passes while the request's batch computes (100 ms into its 300): the 504 comes at the
            # deadline, and its region stays reserved until that batch reads it no more (freed at once, another
            # request could overwrite it).
            batches = (await slow_metrics(link))["visionserve_batches_total"]
            with pytest.raises(DeadlineExceededError):
                await link.submit("slow", 1, one, timeout_ms=100, priority=0, request_id="r", guard_s=30)
            if owner.regions is not None:
                assert owner.regions() == 1  # answered, still read by its 300 ms batch
                await until(lambda: owner.regions() == 0, timeout_s=10)
                assert (await slow_metrics(link))["visionserve_batches_total"] == batches + 1  # freed after it

            with pytest.raises(BadInputError, match="unknown rollout action"):
                await link.rollout("digits", action="nothing")
            rows = await link.stats()
            assert {(r["model"], r["version"]) for r in rows} == {("digits", 1), ("slow", 1)}
            digits = next(r for r in rows if r["model"] == "digits")
            assert digits["batches"] >= 2 and all(isinstance(k, str) for k in digits["batch_sizes"])
            text = (await link.metrics()).decode()
            assert 'visionserve_batches_total{device="cpu",model="digits",version="1"}' in text
            index = await link.index()
            assert {(r["name"], r["state"]) for r in index} == {("digits", "READY"), ("slow", "READY")}
            assert msgspec.to_builtins(index) == index  # plain data, as MessagePack carries it

    asyncio.run(scenario())


def test_a_cancelled_rollout_request_gives_its_region_back(repo: Path, tmp_path: Path) -> None:
    """A request of a running rollout (a canary here, the primary computed beside it) computes on the engine's own
    copy of its pixels: cancelled while both arms compute, its region is free at once, never kept for ever."""
    rollout_repo = tmp_path / "repo"
    shutil.copytree(repo / "slow", rollout_repo / "slow")
    shutil.copytree(rollout_repo / "slow" / "1", rollout_repo / "slow" / "2")
    (rollout_repo / "slow" / "config.toml").write_text(slow_config(delay_ms=300))
    settings = ServerSettings(repository=str(rollout_repo), grpc_port=0)

    async def scenario() -> None:
        async with shared_memory_link(settings, tmp_path) as (link, owner):
            await until(lambda: link.up and link.catalog is not None)
            assert owner.regions is not None
            canary = {"candidate": 2, "mode": "canary", "fraction": 1.0, "auto": False}
            started = await link.rollout("slow", action="start", settings=canary)
            assert started is not None and started["state"] == "running" and started["candidate"] == 2
            one = np.zeros((1, 3, 224, 224), dtype=np.uint8)
            computing = asyncio.ensure_future(submit(link, "slow", one, version=1, route="a"))
            async with asyncio.timeout(30):
                while (await slow_metrics(link))["visionserve_inflight_batches"] < 1:
                    await asyncio.sleep(0.01)
            computing.cancel()
            with pytest.raises(asyncio.CancelledError):
                await computing
            await until(lambda: owner.regions() == 0, timeout_s=10)
            answer = await submit(link, "slow", one, version=1, route="b")  # and the rollout still answers
            assert answer.result.outputs[0].shape[0] > 0

    asyncio.run(scenario())
