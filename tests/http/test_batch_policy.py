"""``batch_policy`` changes the batches a served model forms under load (the batch-size histogram on /metrics).

Three copies of digits, made slow by their config, not by the machine: ``per_image`` costs IMAGE_MS for each image
of a batch (as a CPU does), twice, under the delay and the adaptive policy; ``per_batch`` costs BATCH_MS for a batch
of any size (as a GPU nearly does), under the adaptive policy. The same closed-loop load meets each. The delay
policy fills its batches; the adaptive policy measures that a batch of ``per_image`` costs the same per image at any
size and keeps its batches at the knee, while ``per_batch``'s knee is the maximum and its batches fill.
"""

from __future__ import annotations

import concurrent.futures
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.launcher import RunningServer
from tests.http.conftest import metric_value, start_server, stop_server
from tests.http.test_image_api import digit_png

# A batch's measured cost is its images' delay plus the server's own overhead (the event loop's turn, answering the
# batch), which grows when the machine is busy: a CI run at IMAGE_MS = 20 measured batches cut at 5-6 images, the
# overhead being most of a small batch's cost there. At 60 ms an image the knee stays at 3 while that overhead is
# under 15 ms a batch, and at 4 up to 25 ms (KNEE_SLACK 5%); the bounds below hold to 25 ms.
IMAGE_MS = 60.0
BATCH_MS = 60.0
MAX_BATCH = 8
CLIENTS = 16  # twice the largest batch: a backlog is always queued
REQUESTS = 64  # per model and half, bounded
MODELS = {
    "per_image_delay": f'batch_policy = "delay"\n[faults]\nimage_delay_ms = {IMAGE_MS}\n',
    "per_image_adaptive": f'batch_policy = "adaptive"\n[faults]\nimage_delay_ms = {IMAGE_MS}\n',
    "per_batch_adaptive": f'batch_policy = "adaptive"\n[faults]\ndelay_ms = {BATCH_MS}\n',
}


@pytest.fixture(scope="module")
def policies(served_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("policies")
    for name, table in MODELS.items():
        shutil.copytree(served_repo / "digits", root / name)
        (root / name / "config.toml").write_text(
            f"max_batch_size = {MAX_BATCH}\nmax_queue_delay_ms = 50\nwarmup = false\n{table}"
        )
    running = start_server(root, tmp_path_factory.mktemp("policies-logs") / "server.log", real_models=tuple(MODELS))
    try:
        yield running
    finally:
        stop_server(running)


def mean_batch_under_load(url: str, model: str) -> float:
    """``REQUESTS`` single-image requests from ``CLIENTS`` closed-loop clients, after as many again to learn from;
    the mean batch size the second half formed."""
    load(url, model)
    images = metric_value(url, "visionserve_batch_size_sum", model=model)
    batches = metric_value(url, "visionserve_batch_size_count", model=model)
    load(url, model)
    images = metric_value(url, "visionserve_batch_size_sum", model=model) - images
    batches = metric_value(url, "visionserve_batch_size_count", model=model) - batches
    assert images == REQUESTS  # every image computed once, in some batch
    return images / batches


def load(url: str, model: str) -> None:
    png = digit_png(3)[0]

    def client(count: int) -> list[int]:
        with httpx.Client(base_url=url, timeout=60) as http:
            post = lambda: http.post(f"/v1/models/{model}/classify", content=png, headers={"content-type": "image/png"})  # noqa: E731
            return [post().status_code for _ in range(count)]

    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
        codes = [c for done in pool.map(client, [REQUESTS // CLIENTS] * CLIENTS) for c in done]
    assert codes == [200] * REQUESTS


def test_the_batch_policy_changes_the_batch_size_histogram_under_load(policies: RunningServer) -> None:
    delay = mean_batch_under_load(policies.url, "per_image_delay")
    adaptive = mean_batch_under_load(policies.url, "per_image_adaptive")
    per_batch = mean_batch_under_load(policies.url, "per_batch_adaptive")
    # the delay policy fills batches from the backlog; the adaptive one stops at the knee of a cost that grows
    # with the batch (2-3 images, the rest of a batch's cost being the server's own overhead)
    assert delay >= 5, delay  # 6.7-7.5 seen
    assert adaptive <= 4.5 and adaptive <= delay - 2, (adaptive, delay)  # 2.0-3.9 seen at 20 ms an image
    # where a batch costs the same at any size, the knee is the maximum: the adaptive policy fills its batches too
    assert per_batch >= 5, per_batch  # 6.4 seen
