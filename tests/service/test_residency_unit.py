"""On-demand residency in process, against the real model table and a loader of stand-in versions: one load
shared by all who wait for it, a busy model never evicted, and the release of a request's region on the plain and
on-demand paths (cancelled before queueing, while its batch reads, after its answer; a deadline while a batch
reads). Each runs in milliseconds: no model, no device."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from service.core.errors import DeadlineExceededError, MemoryBudgetError
from service.core.settings import ServerSettings
from service.engine.batcher import InferRequest
from service.engine.ondemand import Residency
from service.engine.server import EngineServer
from service.engine.table import ModelTable
from service.transport.messages import Failed, Result, Submit
from tests.service.engine_fakes import MB, Endpoint, FakeEngine, FakeLoader, entry, images, settle, until


def residency(table: ModelTable, loader: FakeLoader, budget_mb: int = 100) -> Residency:
    return Residency(table, loader, {"cpu": budget_mb * MB}, place=lambda e: "cpu", min_residency_s=0.0)


def test_one_load_is_shared_by_every_request_waiting_for_it(tmp_path: Path) -> None:
    async def scenario() -> None:
        table = ModelTable(lambda: None)
        loader = FakeLoader(table)
        memory = residency(table, loader)
        memory.offer(entry(tmp_path, "m"))
        loader.gate.clear()  # the load stays open while the requests arrive
        waiters = [asyncio.create_task(memory.wait_for("m", None)) for _ in range(3)]
        await until(lambda: bool(loader.calls))
        await settle()
        assert loader.calls == ["m"] and memory.busy("m")  # waiting for its load: busy
        loader.gate.set()
        await asyncio.gather(*waiters)
        assert loader.calls == ["m"] and "m" in table.models and memory.misses["m"] == 3
        assert memory.accounts.charges["m"].bytes == 10 * MB and memory.describe("m")["resident"]

    asyncio.run(asyncio.wait_for(scenario(), 5))


def test_a_busy_model_is_never_evicted_and_an_idle_one_is(tmp_path: Path) -> None:
    async def scenario() -> None:
        table = ModelTable(lambda: None)
        loader = FakeLoader(table)
        memory = residency(table, loader, budget_mb=15)  # room for one 10 MB model
        for name in ("a", "b"):
            memory.offer(entry(tmp_path, name))
        await memory.wait_for("a", None)
        engine = table.models["a"][1]
        assert isinstance(engine, FakeEngine)
        engine.batcher.enqueue(table_request("a"))  # work queued on "a"
        with pytest.raises(MemoryBudgetError, match="no model may be evicted"):
            await memory.wait_for("b", None)
        assert "a" in table.models and not engine.closed and "b" not in table.models
        assert memory.why_not["b"].startswith("refused: ")
        engine.batcher.take()
        engine.batcher.end()  # its work done: now it may go
        await memory.wait_for("b", None)
        assert "a" not in table.models and engine.closed and "b" in table.models
        assert memory.evictions == {("a", "lru"): 1} and memory.why_not["a"].startswith("evicted")

    asyncio.run(asyncio.wait_for(scenario(), 5))


def table_request(model: str) -> InferRequest:
    return InferRequest(request_id="r", model=model, images=images())


# ---- the release of a request's region: the plain and on-demand paths -------------------------------------------


class Engine(EngineServer):
    """The engine server with stand-in versions: its loader puts fakes in the table."""

    def __init__(self, tmp: Path) -> None:
        self.endpoint_fake = Endpoint()
        super().__init__(ServerSettings(repository=str(tmp), metrics=False), self.endpoint_fake)
        self.loader = FakeLoader(self.table)

    async def load_versions(self, entry: object) -> None:
        await self.loader(entry)  # type: ignore[arg-type]


def submit(number: int, model: str, timeout_ms: float = 0.0) -> Submit:
    return Submit(number, model, 1, 0, (1, 3, 8, 8), timeout_ms, 0, f"r{number}")


def frees(engine: Engine, number: int) -> list[str]:
    """What the front end was told of request ``number``: "result", "failed", "held", "released"."""
    said = []
    for _peer, message in engine.endpoint_fake.sent:
        if isinstance(message, Result) and message.id == number:
            said.append("result")
        elif isinstance(message, Failed) and message.id == number:
            kind = message.error.kind
            said.append("held" if message.held else "released" if kind == "CancelledError" else "failed")
    return said


def plain_engine(tmp: Path) -> tuple[Engine, FakeEngine]:
    engine = Engine(tmp)
    version = FakeEngine("m", 1)
    engine.table.put(entry(tmp, "m", on_demand=False), {1: version})  # type: ignore[dict-item]
    return engine, version


def test_plain_path_cancelled_in_the_queue_is_released_at_once(tmp_path: Path) -> None:
    async def scenario() -> None:
        engine, _ = plain_engine(tmp_path)
        engine.submit(b"p", submit(1, "m"), images())
        engine.cancel(b"p", 1)
        await settle()
        assert frees(engine, 1) == ["released"]

    asyncio.run(asyncio.wait_for(scenario(), 5))


def test_plain_path_cancelled_while_its_batch_reads_is_released_when_the_batch_ends(tmp_path: Path) -> None:
    async def scenario() -> None:
        engine, version = plain_engine(tmp_path)
        engine.submit(b"p", submit(1, "m"), images())
        version.batcher.take()
        engine.cancel(b"p", 1)
        await settle()
        assert frees(engine, 1) == []  # the batch still reads the pixels
        version.batcher.end()
        await settle()
        assert frees(engine, 1) == ["released"]

    asyncio.run(asyncio.wait_for(scenario(), 5))


def test_plain_path_deadline_while_its_batch_reads_is_held_then_released(tmp_path: Path) -> None:
    async def scenario() -> None:
        engine, version = plain_engine(tmp_path)
        engine.submit(b"p", submit(1, "m"), images())
        version.batcher.take()
        pending = version.batcher.batch[0]
        pending.finish(DeadlineExceededError("deadline"))  # its timer, while the batch computes
        await settle()
        assert frees(engine, 1) == ["held"]
        version.batcher.end()
        await settle()
        assert frees(engine, 1) == ["held", "released"]

    asyncio.run(asyncio.wait_for(scenario(), 5))


def test_plain_path_answered_is_freed_by_its_answer_alone(tmp_path: Path) -> None:
    async def scenario() -> None:
        engine, version = plain_engine(tmp_path)
        engine.submit(b"p", submit(1, "m"), images())
        version.batcher.take()
        version.batcher.end()
        await settle()
        engine.cancel(b"p", 1)  # too late: nothing more is said
        await settle()
        assert frees(engine, 1) == ["result"]

    asyncio.run(asyncio.wait_for(scenario(), 5))


def test_on_demand_path_cancelled_while_loading_is_released_at_once(tmp_path: Path) -> None:
    async def scenario() -> None:
        engine = Engine(tmp_path)
        engine.residency.offer(entry(tmp_path, "m"))
        engine.loader.gate.clear()
        engine.submit(b"p", submit(1, "m"), images())
        await until(lambda: bool(engine.loader.calls))
        await settle()
        assert engine.loader.calls == ["m"]
        engine.cancel(b"p", 1)
        await settle()
        assert frees(engine, 1) == ["released"]  # never queued: nothing reads its pixels
        engine.loader.gate.set()

    asyncio.run(asyncio.wait_for(scenario(), 5))


def test_on_demand_path_cancelled_while_its_batch_reads_is_released_when_the_batch_ends(tmp_path: Path) -> None:
    async def scenario() -> None:
        engine = Engine(tmp_path)
        engine.residency.offer(entry(tmp_path, "m"))
        engine.submit(b"p", submit(1, "m"), images())
        await until(lambda: "m" in engine.table.models and bool(engine.table.models["m"][1].batcher.queued))
        version = engine.table.models["m"][1]
        assert isinstance(version, FakeEngine) and version.batcher.queued
        version.batcher.take()
        engine.cancel(b"p", 1)
        await settle()
        assert frees(engine, 1) == []
        version.batcher.end()
        await settle()
        assert frees(engine, 1) == ["released"]

    asyncio.run(asyncio.wait_for(scenario(), 5))


def test_on_demand_path_answered_says_how_long_it_waited(tmp_path: Path) -> None:
    async def scenario() -> None:
        engine = Engine(tmp_path)
        engine.residency.offer(entry(tmp_path, "m"))
        engine.submit(b"p", submit(1, "m"), images())
        await until(lambda: "m" in engine.table.models and bool(engine.table.models["m"][1].batcher.queued))
        version = engine.table.models["m"][1]
        assert isinstance(version, FakeEngine)
        version.batcher.take()
        version.batcher.end()
        await settle()
        assert frees(engine, 1) == ["result"]
        result = next(m for _, m in engine.endpoint_fake.sent if isinstance(m, Result))
        assert result.cold_start_s >= 0.0 and engine.residency.loads == {("m", "on_demand"): 1}

    asyncio.run(asyncio.wait_for(scenario(), 5))
