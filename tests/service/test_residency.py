"""The accounts behind many models per device: sizes and budgets as written, and the choice of what to evict
(least recently used first; never pinned, busy or younger than the minimum residency; a wait when only a young
model would do; a model over the whole budget refused with its size)."""

from __future__ import annotations

import time

import pytest

from service.core.errors import ConfigError
from service.core.settings import ServerSettings, parse_budget, parse_size
from service.engine.residency import Accounts, NoRoom, budget_for, used_bytes

MB = 1_000_000


def test_sizes_and_budgets_read_as_written() -> None:
    assert parse_size("2GB") == 2_000_000_000 and parse_size("1.5GiB") == 1_610_612_736
    assert parse_size("512mb") == 512 * MB and parse_size("4096") == 4096 and parse_size("64 MiB") == 64 << 20
    assert parse_budget("2GB") == {"*": 2_000_000_000}
    assert parse_budget("cpu=8GB,cuda:0=60GB") == {"cpu": 8_000_000_000, "cuda:0": 60_000_000_000}
    assert budget_for({"cuda": 5, "*": 7}, "cuda:1") == 5 and budget_for({"cuda": 5, "*": 7}, "cpu") == 7
    assert budget_for({}, "cpu") > 0 and used_bytes("cpu") > 0
    for bad in ("2 parsecs", "cpu=", "gpu=2GB", "-1GB"):
        with pytest.raises(ConfigError):
            parse_budget(bad)
    with pytest.raises(ConfigError, match="memory size"):
        ServerSettings(memory_budget="lots")


def accounts(**models: tuple[int, bool]) -> Accounts:
    """Models charged in the order given (the first is the least recently used), none of them young."""
    books = Accounts({"cpu": 300 * MB}, min_residency_s=0.0)
    for name, (size_mb, pinned) in models.items():
        books.charge(name, "cpu", size_mb * MB, pinned=pinned)
        time.sleep(0.001)  # a distinct last use each
    return books


def test_the_least_recently_used_go_first_and_only_as_many_as_needed() -> None:
    books = accounts(a=(100, False), b=(100, False), c=(100, False))
    assert books.victims("cpu", 0, lambda m: False) == []
    assert books.victims("cpu", 100 * MB, lambda m: False) == ["a"]
    books.touch("a")  # used now: b is the oldest
    assert books.victims("cpu", 150 * MB, lambda m: False) == ["b", "c"]


def test_pinned_and_busy_models_never_go_and_nothing_left_is_no_room() -> None:
    books = accounts(p=(100, True), a=(100, False), b=(100, False))
    assert books.victims("cpu", 100 * MB, lambda m: m == "a") == ["b"]
    with pytest.raises(NoRoom, match=r"budget of 300.0 MB is full .* 1 pinned") as info:
        books.victims("cpu", 100 * MB, lambda m: m in ("a", "b"))
    assert info.value.wait_s is None


def test_a_young_model_is_waited_for_not_evicted() -> None:
    books = Accounts({"cpu": 200 * MB}, min_residency_s=30.0)
    books.charge("a", "cpu", 150 * MB, pinned=False)
    with pytest.raises(NoRoom, match="loaded under 30 s ago") as info:
        books.victims("cpu", 100 * MB, lambda m: False)
    assert info.value.wait_s is not None and 29 < info.value.wait_s <= 30


def test_a_model_over_the_whole_budget_is_refused_with_its_size() -> None:
    with pytest.raises(NoRoom, match=r"needs 1.00 GB, more than the whole cpu memory budget of 300.0 MB"):
        accounts().victims("cpu", 1_000 * MB, lambda m: False)
