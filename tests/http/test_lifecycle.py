"""The server's life: SIGTERM turns readiness false, refuses new work, finishes what was accepted, exits in time.

The model here is slow by its config (``[faults] delay_ms``, :func:`slow_config`): work is still queued and
computing when SIGTERM arrives on any machine, however fast.
"""

from __future__ import annotations

import concurrent.futures
import shutil
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import encode_image, random_image
from tests.http.conftest import slow_config, start_server, stop_server, wait_for_metric


@pytest.fixture
def slow_repo(served_repo: Path, tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copytree(served_repo / "slow", root / "slow")
    (root / "slow" / "config.toml").write_text(slow_config())
    return root


def wait_until_queued(url: str, queued: int) -> None:
    """Until the engine holds work: one batch computing and ``queued`` images waiting behind it. Each batch takes
    SLOW_DELAY_MS, so this state lasts that long per request still to come: no poll can miss it."""
    wait_for_metric(url, "visionserve_inflight_batches", 1, model="slow")
    wait_for_metric(url, "visionserve_queue_depth", queued, model="slow")


def test_sigterm_drains_accepted_work_and_exits_within_the_bound(slow_repo: Path, tmp_path: Path) -> None:
    server = start_server(slow_repo, tmp_path / "server.log", "--drain-timeout-s", "20")
    image = encode_image(random_image(224, 224), "JPEG")

    def classify(_: int) -> int:
        try:
            with httpx.Client(base_url=server.url, timeout=60) as c:
                r = c.post("/v1/models/slow/classify", content=image, headers={"content-type": "image/jpeg"})
                return r.status_code
        except httpx.TransportError:
            return -1  # refused at the socket: the server had stopped accepting, which is allowed

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        accepted = [pool.submit(classify, i) for i in range(6)]
        wait_until_queued(server.url, 2)  # the engine holds them: accepted, not in a socket backlog
        server.process.send_signal(signal.SIGTERM)
        stopped_at = time.monotonic()
        codes = [f.result() for f in accepted]
    returncode = server.process.wait(30)
    took = time.monotonic() - stopped_at
    assert returncode == 0
    assert took < 25  # the drain bound (20 s) plus start-up of the exit
    assert codes.count(200) >= 3  # what the engine held at SIGTERM was computed, not dropped
    assert set(codes) <= {200, 503, -1}, codes
    log = (tmp_path / "server.log").read_text()
    assert "draining" in log and "Traceback" not in log


def test_readiness_reports_false_while_draining(slow_repo: Path, tmp_path: Path) -> None:
    server = start_server(slow_repo, tmp_path / "server.log", "--drain-timeout-s", "5")
    image = encode_image(random_image(224, 224), "JPEG")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:

        def busy() -> None:
            with httpx.Client(base_url=server.url, timeout=60) as c:
                c.post("/v1/models/slow/classify", content=image, headers={"content-type": "image/jpeg"})

        work = [pool.submit(busy) for _ in range(3)]
        wait_until_queued(server.url, 2)  # about 3 x SLOW_DELAY_MS of work still to do
        server.process.send_signal(signal.SIGTERM)
        seen = []
        for _ in range(20):
            try:
                seen.append(httpx.get(server.url + "/v2/health/ready", timeout=2).status_code)
            except httpx.TransportError:
                break
            time.sleep(0.05)
        for w in work:
            w.result()
    assert stop_server(server) == 0  # a second SIGTERM while it winds down still ends in a clean exit
    assert seen, "readiness was never answered after SIGTERM"
    assert 200 not in seen  # never ready again after SIGTERM (503, or no longer accepting at all)


def test_sigterm_repeated_through_the_shutdown_still_exits_zero(slow_repo: Path, tmp_path: Path) -> None:
    """A supervisor that repeats SIGTERM must not turn a clean drain into death by signal (-15)."""
    server = start_server(slow_repo, tmp_path / "server.log", "--drain-timeout-s", "5")
    deadline = time.monotonic() + 30
    while server.process.poll() is None and time.monotonic() < deadline:
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.01)
    assert server.process.wait(5) == 0
    assert "Traceback" not in (tmp_path / "server.log").read_text()
