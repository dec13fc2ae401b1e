"""A served digits model for the client's tests, and a folder of images with a corrupt file and a non-image."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from sklearn.datasets import load_digits

from service.core.settings import ServerSettings
from service.inprocess import InProcessServer
from tests.conftest import copy_model, encode_image

MAX_IMAGES = 4  # the server's --max-images: below the client's default, so splitting is exercised


def digit_pixels(index: int) -> tuple[np.ndarray, int]:
    """A real handwritten digit (8x8, scaled to 0..255) and its label."""
    raw = load_digits()
    return np.rint(raw.images[index] * (255.0 / 16.0)).astype(np.uint8), int(raw.target[index])


@pytest.fixture(scope="session")
def client_repo(digits_export: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return copy_model(digits_export, tmp_path_factory.mktemp("client-repo"))


@pytest.fixture(scope="session")
def client_server(client_repo: Path) -> Iterator[InProcessServer]:
    """The server the client talks to, in this process (the client's tests are about the client: real HTTP, no
    server processes; tests/client/test_classify_restart.py kills a real one)."""
    settings = ServerSettings(repository=str(client_repo), max_images_per_request=MAX_IMAGES, port=0, grpc_port=0)
    with InProcessServer(settings) as running:
        yield running


@pytest.fixture(scope="session")
def digit_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    """(folder, {path: label}) holding 11 digits (PNG and JPEG, one with no extension, some in a sub-folder),
    a corrupt PNG, a text file and a text file named .jpg."""
    root = tmp_path_factory.mktemp("digits-folder")
    (root / "b" / "deeper").mkdir(parents=True)
    labels: dict[str, int] = {}
    for i in range(11):
        pixels, label = digit_pixels(i)
        fmt, name = ("PNG", f"digit-{i:02d}.png") if i % 3 else ("BMP", f"digit-{i:02d}.bmp")
        where = root / ("b" if i % 2 else "") / ("deeper" if i % 4 == 3 else "")
        path = where / name
        if i == 5:
            path = where / "scan-without-extension"
        path.write_bytes(encode_image(pixels, fmt))
        labels[str(path)] = label
    corrupt = root / "b" / "corrupt.png"
    corrupt.write_bytes(encode_image(digit_pixels(20)[0], "PNG")[:40])  # the PNG header, then nothing
    labels[str(corrupt)] = -1
    (root / "notes.txt").write_text("not an image\n")
    (root / "b" / "fake.jpg").write_text("not an image either, whatever the name says\n")
    return root, labels
