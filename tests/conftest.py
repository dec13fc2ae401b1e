"""Shared fixtures: marker handling, generated images, a trained digits checkpoint (made once per run)."""

from __future__ import annotations

import io
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is usable here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _server_registry():  # type: ignore[no-untyped-def]
    """tests/http/conftest.py, where every test server starts, if anything has imported it yet."""
    return sys.modules.get("tests.http.conftest")


@pytest.fixture(autouse=True)
def _no_server_outlives_its_test() -> Iterator[None]:
    """Every server a test (or a function-scoped fixture) started is stopped when it ends, passed or failed."""
    servers = _server_registry()
    since = len(servers._STARTED) if servers is not None else 0
    yield
    servers = _server_registry()
    if servers is not None:
        servers.stop_leftover_servers(since)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    servers = _server_registry()
    if servers is not None:  # a session fixture's own teardown failed: still nothing left running
        servers.stop_leftover_servers(0)


def encode_image(array: np.ndarray, fmt: str = "PNG", **params: object) -> bytes:
    """Encode an HxW or HxWx3 uint8 array as an image file."""
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format=fmt, **params)
    return buf.getvalue()


def random_image(height: int, width: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # Smooth gradients plus noise: closer to a photo than pure noise, so JPEG behaves as it does on photos.
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([xx * 255 / max(width - 1, 1), yy * 255 / max(height - 1, 1), (xx + yy) % 256], axis=-1)
    noise = rng.normal(0, 20, size=(height, width, 3))
    return np.clip(base + noise, 0, 255).astype(np.uint8)


@pytest.fixture(scope="session")
def digits_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """smallcnn trained briefly on digits: real weights for export and serving tests."""
    from models.train import TrainConfig, train

    path = tmp_path_factory.mktemp("ckpt") / "digits.pt"
    train(TrainConfig(epochs=4, out=str(path)))
    return path
