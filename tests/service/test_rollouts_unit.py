"""Rollouts in process, against the real model table and memory accounts and stand-in versions: a rollout started
by request (its candidate loaded and charged under its :class:`VersionKey`), promoted, aborted, and a cancelled
rollout request whose region is released at once (the rollout computes on the engine's own copy). Milliseconds
each: no model, no device."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import msgspec

from service.core.config import RolloutConfig
from service.core.errors import BadInputError
from service.engine.ondemand import Residency
from service.engine.rollout import Rollouts
from service.engine.table import ModelTable
from service.transport.messages import Failed, RolloutQuery, VersionKey
from tests.service.engine_fakes import MB, FakeEngine, FakeLoader, entry, images, settle
from tests.service.test_residency_unit import frees, plain_engine, submit

SHADOW = {"candidate": 2, "mode": "shadow", "fraction": 1.0, "auto": False}


class Parts:
    """The table, the accounts and the rollouts of one engine, model ``m`` loaded at ``versions``."""

    def __init__(self, tmp: Path, versions: tuple[int, ...], rollout: RolloutConfig | None = None) -> None:
        self.announced = 0
        self.table = ModelTable(self._announce)
        self.loader = FakeLoader(self.table)
        self.memory = Residency(self.table, self.loader, {"cpu": 100 * MB}, place=lambda e: "cpu")
        self.entry = entry(tmp, "m", versions=(1, 2), on_demand=False, rollout=rollout)
        repository = SimpleNamespace(model=lambda name: self.entry)
        self.rollouts = Rollouts(self.table, self.memory, repository, self.loader.engine)  # type: ignore[arg-type]
        self.table.put(self.entry, {n: FakeEngine("m", n) for n in versions})  # type: ignore[misc]
        self.memory.accounts.charge("m", "cpu", 10 * MB, pinned=True)
        self.lock = asyncio.Lock()

    def _announce(self) -> None:
        self.announced += 1

    async def call(self, action: str | None = None, **kw: object) -> dict[str, object] | None:
        return await self.rollouts.control(RolloutQuery("m", action, **kw), self.lock)  # type: ignore[arg-type]


def test_a_candidate_loaded_for_its_rollout_is_charged_under_its_key_and_promoted(tmp_path: Path) -> None:
    async def scenario() -> None:
        parts = Parts(tmp_path, versions=(1,))
        started = await parts.call("start", settings=SHADOW)
        assert started is not None and started["state"] == "running" and started["primary"] == 1
        assert parts.loader.calls == ["m/2"] and set(parts.table.models["m"]) == {1, 2}
        assert VersionKey("m", 2) in parts.memory.accounts.charges  # charged as itself, beside the model
        assert parts.rollouts.routes() == {"m": 1} and parts.announced >= 1
        old = parts.table.models["m"][1]
        before = parts.table.version
        promoted = await parts.call("promote", reason="agrees")
        assert promoted is not None and promoted["state"] == "promoted" and promoted["serving"] == 2
        assert set(parts.table.models["m"]) == {2} and isinstance(old, FakeEngine) and old.closed
        assert VersionKey("m", 2) not in parts.memory.accounts.charges and "m" in parts.memory.accounts.charges
        assert parts.rollouts.version_for("m", 1) == 2 and parts.table.version > before
        record = json.loads((tmp_path / "m" / "rollout.json").read_text())
        assert record["state"] == "promoted" and record["reason"] == "agrees"
        assert parts.rollouts.retired(parts.entry) == {1}  # not loaded again after a restart

    asyncio.run(asyncio.wait_for(scenario(), 5))


def test_an_abort_closes_the_candidate_and_gives_back_its_charge(tmp_path: Path) -> None:
    async def scenario() -> None:
        parts = Parts(tmp_path, versions=(1,))
        await parts.call("start", settings=SHADOW)
        candidate = parts.table.models["m"][2]
        aborted = await parts.call("abort")
        assert aborted is not None and aborted["state"] == "aborted" and aborted["reason"] == "abort asked by request"
        assert set(parts.table.models["m"]) == {1} and isinstance(candidate, FakeEngine) and candidate.closed
        assert VersionKey("m", 2) not in parts.memory.accounts.charges and not parts.memory.accounts.leaving
        assert parts.rollouts.version_for("m", 2) == 1 and parts.rollouts.retired(parts.entry) == {2}

    asyncio.run(asyncio.wait_for(scenario(), 5))


def test_a_rollout_from_config_starts_when_its_model_loads(tmp_path: Path) -> None:
    parts = Parts(tmp_path, versions=(1, 2), rollout=RolloutConfig(candidate=2, mode="canary", fraction=0.5))
    parts.rollouts.loaded(parts.entry)
    document = parts.rollouts.document("m")
    assert document["state"] == "running" and document["mode"] == "canary" and document["candidate"] == 2
    assert parts.rollouts.routes() == {"m": 1}


def test_a_rollout_between_two_tasks_is_refused_by_request_and_from_config(tmp_path: Path) -> None:
    """A rollout compares answers of one kind: a detector's candidate beside a classifier is refused with the
    reason, and the candidate loaded for it goes again with its charge."""

    async def scenario() -> None:
        parts = Parts(tmp_path, versions=(1,))
        parts.table.models["m"][1].spec.task = "detect"
        parts.table.models["m"][1].spec.output_layout = "candidates"
        try:
            await parts.call("start", settings=SHADOW)
        except BadInputError as exc:
            assert "is a classify model (logits) beside v1's detect (candidates)" in str(exc)
        else:
            raise AssertionError("a rollout across tasks started")
        assert set(parts.table.models["m"]) == {1} and VersionKey("m", 2) not in parts.memory.accounts.charges
        assert parts.rollouts.document("m")["state"] == "none"

    asyncio.run(asyncio.wait_for(scenario(), 5))
    configured = Parts(tmp_path, versions=(1, 2), rollout=RolloutConfig(candidate=2, mode="canary", fraction=0.5))
    configured.table.models["m"][2].spec.task = "detect"
    configured.rollouts.loaded(configured.entry)  # logged, no rollout; the model loads as ever
    assert configured.rollouts.document("m")["state"] == "none" and configured.rollouts.routes() == {}


def test_a_cancelled_rollout_request_is_released_at_once(tmp_path: Path) -> None:
    """The rollout's arms compute on the engine's own copy of the pixels: the sender's region is free at a cancel,
    while both batches still compute."""

    async def scenario() -> None:
        engine, primary = plain_engine(tmp_path)
        candidate = FakeEngine("m", 2)
        engine.table.models["m"][2] = candidate  # type: ignore[assignment]
        await engine.rollouts.control(RolloutQuery("m", "start", SHADOW), asyncio.Lock())
        engine.submit(b"p", msgspec.structs.replace(submit(1, "m"), route=""), images())  # names no version
        await settle()
        assert primary.batcher.queued and candidate.batcher.queued  # answered by one, compared on the other
        primary.batcher.take()
        candidate.batcher.take()
        engine.cancel(b"p", 1)
        await settle()
        assert frees(engine, 1) == ["released"]
        primary.batcher.end()
        candidate.batcher.end()
        await settle()
        assert frees(engine, 1) == ["released"]  # once
        assert not [m for _, m in engine.endpoint_fake.sent if isinstance(m, Failed) and m.id != 1]

    asyncio.run(asyncio.wait_for(scenario(), 5))
