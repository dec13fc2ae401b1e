"""Shared fixtures: marker handling, generated images, a trained digits checkpoint (made once per run)."""

from __future__ import annotations

import io
import os
import shutil
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

# Ctrl-C as at a terminal for the commands the tests interrupt (watch, tune). A suite started where SIGINT is ignored
# (a background job of a non-interactive shell) would pass that on through exec, and the command would never hear
# the interrupt it is tested on. Mended here, not in each child's preexec_fn: a fork that runs Python before exec,
# in a process with gRPC loaded, restarts gRPC's poller in the child, which then writes an epoll error on the
# child's stderr as its descriptors are closed (a fresh-clone run, 2026-11-28).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


# The tests that judge timing or load, with why: `make test` runs them after the parallel phase, one after another
# with the machine to themselves (scripts/test-suite.sh, docs/testing.md "Two phases"). A key is a module or a test's
# node id, or the start of a test's name (its node id up to a word's end).
ALONE = {
    "tests/reliability/test_overload.py": "capacity measured, then refusal times and p99 against the queue's bound",
    "tests/reliability/test_faults.py": "deadlines answered within bounds while decoders are saturated",
    "tests/reliability/test_hostile_clients.py": "ordinary clients answered within bounds beside hostile ones",
    "tests/http/test_batch_policy.py": "batch sizes formed under load depend on each batch's measured cost",
    "tests/loadtest/test_accuracy.py": "a load generator's measured latencies within a few ms of the truth",
    "tests/loadtest/test_cli.py": "rates reached and batch costs seen in a real load test",
    "tests/grpc/test_stream.py::test_a_burst_supersedes": "which frames a burst supersedes depends on when each comes",
    "tests/grpc/test_stream.py::test_frames_older": "the stream's 5 ms age bound holds its first frame too",
    "tests/grpc/test_stream.py::test_a_stream_across_a_drain": "the 10 frames sent before SIGTERM must all be read",
    "tests/http/test_streams.py::test_supersede_and_expiry": "a 100 ms age bound must see its first frame decoded",
    "tests/deploy/test_ray.py": "Ray's own start-up timeouts (its local cluster) fail on a machine busy with tests",
    "tests/http/test_many_models.py::test_nothing_evictable": "a request queued behind a 400 ms batch is seen queued",
    # busy_model: each sees one 400 ms batch computing before it acts; polling /metrics beside other work missed it
    "tests/http/test_v2.py::test_overload_is_refused_at_once": "a flood sent while one 400 ms batch runs is refused",
    "tests/http/test_v2.py::test_a_request_whose_deadline": "a request queued behind a 400 ms batch expires",
    "tests/grpc/test_grpc.py::test_a_full_queue_is_refused": "a flood sent while one 400 ms batch runs is refused",
    "tests/grpc/test_grpc.py::test_a_deadline_passed_in_the_queue": "a request queued behind a 400 ms batch expires",
    "tests/grpc/test_stages.py::test_compute_and_waiting": "a request queued behind a computing batch is timed",
    "tests/http/test_metrics.py::test_counters_and_histograms": "a flood and a deadline behind a 400 ms batch",
    "tests/sources/test_sources_live.py::test_a_camera_that_restarts": "running again within 2 s of the restart",
    "tests/http/test_event_loop.py::test_the_heaviest": "the loop's 50 ms lag bound is the OS's too (busy cores)",
}


def _alone(item: pytest.Item) -> bool:
    return any(item.nodeid == key or item.nodeid.startswith((f"{key}::", f"{key}_", f"{key}[")) for key in ALONE)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _alone(item):
            item.add_marker(pytest.mark.alone)
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


ONCE_DIR = "VISIONSERVE_TEST_ONCE_DIR"


def made_once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], object]) -> Path:
    """The folder ``name``, filled by ``make`` once per run of the suite: pytest-xdist's workers share it (behind a
    file lock, the first to ask making it), and so do both phases of scripts/test-suite.sh, which names a folder for
    them in VISIONSERVE_TEST_ONCE_DIR. Never modify what is in it."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    if os.environ.get(ONCE_DIR):
        base = Path(os.environ[ONCE_DIR])
    elif os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the run's root; each worker's own temporary root is below it
    folder = base / f"once-{name}"
    with FileLock(f"{folder}.lock"):
        made = base / f"once-{name}.made"  # beside it: the folder may be a model repository, read whole
        if not made.exists():
            shutil.rmtree(folder, ignore_errors=True)  # a worker that failed while making it left part of it
            folder.mkdir()
            make(folder)
            made.touch()
    return folder


@pytest.fixture(scope="session")
def digits_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """smallcnn trained briefly on digits: real weights for export and serving tests (trained once per run)."""
    from models.train import TrainConfig, train

    def make(folder: Path) -> None:
        train(TrainConfig(epochs=4, out=str(folder / "digits.pt")))

    return made_once(tmp_path_factory, "ckpt", make) / "digits.pt"


# The slow models' fixed cost per batch: long enough that a 50 ms poll cannot miss a batch computing and that a
# burst of concurrent requests arrives well within one batch, short enough to keep the tests quick.
SLOW_DELAY_MS = 400.0


def slow_config(*, max_queue_size: int = 1024, queue_full_status: int = 503, delay_ms: float = SLOW_DELAY_MS) -> str:
    """config.toml of a model that is slow by construction: batches of one, each held ``delay_ms`` on the runtime's
    worker thread, whatever the hardware."""
    return (
        f"max_batch_size = 1\nmax_queue_delay_ms = 0\nmax_queue_size = {max_queue_size}\n"
        f"queue_full_status = {queue_full_status}\n[faults]\ndelay_ms = {delay_ms}\n"
    )


@pytest.fixture(scope="session")
def digits_export(digits_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The trained digits model exported once per run as ``visionserve export`` writes it (ONNX and TorchScript,
    export's default config.toml), alone in a repository. Never modify it: fixtures copy it (:func:`copy_model`)."""
    from export.exporter import ExportRequest, export_model
    from export.sources import from_checkpoint

    def make(root: Path) -> None:
        digits = from_checkpoint(digits_checkpoint)
        export_model(digits.eager, digits.spec, ExportRequest(name="digits", repository=str(root), latency=False))

    return made_once(tmp_path_factory, "digits-export", make)


def copy_model(source: Path, target: Path, name: str = "digits", *, as_name: str | None = None) -> Path:
    """``source``/``name`` copied to ``target``/``as_name`` (default: the same name); the new repository root."""
    shutil.copytree(source / name, target / (as_name or name))
    return target


@pytest.fixture(scope="session")
def served_repo(digits_export: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repository most server tests serve, made once per run: digits (trained), digits2 (a copy for
    load/unload), and ``slow`` and ``slow429``: a 224x224 model (initial weights) slow by its config
    (:func:`slow_config`) with a queue of 2, for overload and deadline tests."""
    from export.exporter import ExportRequest, export_model
    from export.sources import from_architecture

    root = tmp_path_factory.mktemp("served")
    copy_model(digits_export, root)
    copy_model(digits_export, root, as_name="digits2")
    slow = from_architecture("smallcnn", input_size=224)
    export_model(
        slow.eager, slow.spec, ExportRequest(name="slow", repository=str(root), formats=("onnx",), latency=False)
    )
    (root / "slow" / "config.toml").write_text(slow_config(max_queue_size=2))
    shutil.copytree(root / "slow", root / "slow429")
    (root / "slow429" / "config.toml").write_text(slow_config(max_queue_size=2, queue_full_status=429))
    return root
