"""The shared-memory arenas: regions never overlap, freed space merges back, a full arena refuses at once, and
names are released."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.core.errors import OverloadedError, PayloadTooLargeError
from service.transport import shm


@pytest.fixture
def segment() -> Iterator[str]:
    name = shm.new_name("test")
    shm.create(name, 1 << 16).close()
    yield name
    shm.unlink(name)


def test_a_region_written_by_the_front_end_is_what_the_engine_reads(segment: str) -> None:
    arena = shm.Arena(segment)
    reader = shm.ArenaReader(segment)
    offset, view = arena.allocate((2, 3, 4, 4))
    view[:] = np.arange(96, dtype=np.uint8).reshape(2, 3, 4, 4)
    seen = reader.view(offset, (2, 3, 4, 4))
    assert np.array_equal(seen, np.arange(96, dtype=np.uint8).reshape(2, 3, 4, 4))
    assert not seen.flags.writeable
    del view, seen
    arena.free(offset)
    assert arena.free_bytes == arena.size
    arena.close()
    assert reader.close()


def test_a_full_arena_refuses_at_once_and_a_huge_tensor_is_too_large(segment: str) -> None:
    arena = shm.Arena(segment)
    offset, _ = arena.allocate((1, 3, 100, 100))  # 30,000 of 65,536 bytes
    arena.allocate((1, 3, 100, 100))
    with pytest.raises(OverloadedError, match="no free shared-memory slot"):
        arena.allocate((1, 3, 100, 100))
    with pytest.raises(PayloadTooLargeError):
        arena.allocate((1, 3, 200, 200))
    arena.free(offset)
    arena.allocate((1, 3, 100, 100))  # the freed region is usable again
    arena.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 9000)), max_size=60))
def test_regions_never_overlap_and_all_space_comes_back(segment: str, steps: list[tuple[bool, int]]) -> None:
    arena = shm.Arena(segment)
    live: dict[int, int] = {}
    for allocate, size in steps:
        if allocate or not live:
            try:
                offset, _ = arena.allocate((size,))
            except OverloadedError:
                continue
            for other, other_size in live.items():
                assert offset + size <= other or other + other_size <= offset, "regions overlap"
            live[offset] = size
        else:
            offset = sorted(live)[size % len(live)]
            arena.free(offset)
            del live[offset]
    for offset in list(live):
        arena.free(offset)
    assert arena.free_bytes == arena.size
    assert arena.allocate((arena.size,))[0] == 0  # merged back into one block
    arena.close()


def test_unlink_removes_the_name_and_attaching_does_not_own_it(segment: str) -> None:
    reader = shm.ArenaReader(segment)
    assert reader.close()
    assert Path("/dev/shm", segment).exists()  # attaching and closing left it alone
    shm.unlink(segment)
    assert not Path("/dev/shm", segment).exists()
    shm.unlink(segment)  # twice is fine
