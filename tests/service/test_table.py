"""The engine's model table: one change notification (the catalog's version moves on and the front ends are told,
from the event loop or a load's worker thread), lookups that say why a model is not there, and errors keyed by
model or by :class:`VersionKey`, whose one written form is the catalog's."""

from __future__ import annotations

import asyncio
import threading

import pytest

from service.core.errors import NotFoundError
from service.engine.table import ModelTable
from service.transport.messages import VersionKey
from tests.service.engine_fakes import FakeEngine


def test_a_change_moves_the_catalog_version_on_and_announces_it() -> None:
    told: list[int] = []
    table = ModelTable(lambda: told.append(table.version))

    async def scenario() -> None:
        table.changed()
        table.changed()

    asyncio.run(scenario())
    assert table.version == 3 and told == [2, 3]


def test_a_change_on_a_worker_thread_is_announced_on_the_event_loop() -> None:
    told: list[bool] = []
    table = ModelTable(lambda: told.append(threading.current_thread() is threading.main_thread()))

    async def scenario() -> None:
        table.changed()  # on the loop: the loop is known from here on
        await asyncio.to_thread(table.changed)  # a fallback while a version loads, in its thread
        await asyncio.sleep(0.01)

    asyncio.run(scenario())
    assert table.version == 3 and told == [True, True]


def test_a_lookup_says_why_a_model_or_version_is_not_there() -> None:
    table = ModelTable(lambda: None)
    table.failed("broken", "no usable version")
    with pytest.raises(NotFoundError, match=r"unknown model 'broken' \(no usable version\)"):
        table.engine("broken", 1)
    table.models["digits"] = {1: FakeEngine("digits", 1)}  # type: ignore[dict-item]
    with pytest.raises(NotFoundError, match=r"model 'digits' has no version 2 \(versions: \[1\]\)"):
        table.engine("digits", 2)
    assert table.engine("digits", 1) is table.models["digits"][1]


def test_errors_by_version_key_travel_as_name_slash_version() -> None:
    table = ModelTable(lambda: None)
    key = VersionKey("digits", 2)
    assert str(key) == "digits/2" and key == VersionKey("digits", 2) and {key: 1}[VersionKey("digits", 2)] == 1
    table.failed(key, "bad weights")
    table.failed(VersionKey("digits", 3), "no file")
    table.failed("other", "config refused")
    assert table.wire_errors() == {"digits/2": "bad weights", "digits/3": "no file", "other": "config refused"}
    assert table.load_error("digits") == "bad weights; no file" and table.has_errors("digits")
    table.forget_errors("digits")
    assert table.wire_errors() == {"other": "config refused"} and not table.has_errors("digits")
