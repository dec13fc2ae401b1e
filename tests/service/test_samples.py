"""Generated sample images: any size a user asks the load tester or the benchmark for."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from service.core.samples import photo_like_jpegs


@pytest.mark.parametrize("size", [(1, 1), (8, 8), (32, 32), (61, 40), (500, 375)])
def test_photo_like_jpegs_come_in_any_size(size: tuple[int, int]) -> None:
    images = photo_like_jpegs(3, size)
    assert len(images) == 3
    for data in images:
        with Image.open(io.BytesIO(data)) as img:
            assert img.format == "JPEG" and img.size == size and img.mode == "RGB"


def test_photo_like_jpegs_are_the_same_for_the_same_seed_and_differ_between_images() -> None:
    first, again = photo_like_jpegs(4, (64, 48)), photo_like_jpegs(4, (64, 48))
    assert first == again
    assert len(set(first)) == 4
