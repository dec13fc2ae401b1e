"""Where each request's time went: the stage histograms and ``Server-Timing``, on real served requests.

The stages (``service.core.metrics.STAGES``) run one after another from the request's arrival to its answer, so
they must sum to the request's total; and each must hold the wait its name says, which the models here make certain
by their config, not by the machine's speed: ``paced`` holds every batch ``PACED_MS`` on its runtime's thread
(batches of one, so a second request waits for the instance), ``gathering`` waits ``GATHER_MS`` for a batch to fill.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp

from service.core.metrics import STAGES
from tests.grpc.conftest import GrpcServer, wait_for_grpc
from tests.grpc.test_grpc import images_input, pixels_input
from tests.http.conftest import busy_model, free_port, start_server, stop_server
from tests.http.test_image_api import digit_png

PACED_MS = 1000.0  # long, so that the second request surely arrives while the first computes
GATHER_MS = 200.0
# The stage sums and the request total are taken from the same clock readings, so they differ only by float
# rounding; Server-Timing rounds each of its 11 figures to a microsecond.
SUM_TOLERANCE_S = 1e-6
HEADER_TOLERANCE_MS = 0.012


@pytest.fixture(scope="module")
def staged(served_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GrpcServer]:
    root = tmp_path_factory.mktemp("staged")
    shutil.copytree(served_repo / "digits", root / "digits")
    shutil.copytree(served_repo / "digits", root / "paced")
    (root / "paced" / "config.toml").write_text(
        f"max_batch_size = 1\nmax_queue_delay_ms = 0\n[faults]\ndelay_ms = {PACED_MS}\n"
    )
    shutil.copytree(served_repo / "digits", root / "gathering")
    (root / "gathering" / "config.toml").write_text(
        f'max_batch_size = 8\nmax_queue_delay_ms = {GATHER_MS}\nbatch_policy = "delay"\n'
    )
    shutil.copytree(root / "gathering", root / "adaptive")
    (root / "adaptive" / "config.toml").write_text(
        f'max_batch_size = 8\nmax_queue_delay_ms = {GATHER_MS}\nbatch_policy = "adaptive"\n'
    )
    port = free_port()
    running = start_server(root, tmp_path_factory.mktemp("staged-logs") / "server.log", "--grpc-port", str(port))
    try:
        wait_for_grpc(f"127.0.0.1:{port}")
        yield GrpcServer(running, f"127.0.0.1:{port}")
    finally:
        stop_server(running)


def scrape(url: str, model: str) -> dict[str, float]:
    """``name|stage|protocol`` -> value for the stage family's sums and counts, and the request durations."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if f'model="{model}"' not in line or "_bucket" in line:
            continue
        name = line.split("{", 1)[0]
        if name.startswith(("visionserve_stage_duration_seconds", "visionserve_request_duration_seconds")):
            labels = dict(part.split("=", 1) for part in line.split("{", 1)[1].split("}", 1)[0].split(","))
            key = f"{name}|{labels.get('stage', '').strip(chr(34))}|{labels['protocol'].strip(chr(34))}"
            out[key] = float(line.rsplit(" ", 1)[1])
    return out


def stage_means_ms(before: dict[str, float], after: dict[str, float], protocol: str) -> dict[str, float]:
    means = {}
    for stage in STAGES:
        n = after[f"visionserve_stage_duration_seconds_count|{stage}|{protocol}"] - before.get(
            f"visionserve_stage_duration_seconds_count|{stage}|{protocol}", 0.0
        )
        total = after[f"visionserve_stage_duration_seconds_sum|{stage}|{protocol}"] - before.get(
            f"visionserve_stage_duration_seconds_sum|{stage}|{protocol}", 0.0
        )
        means[stage] = 1000 * total / n if n else float("nan")
    return means


def header_stages(response: httpx.Response) -> dict[str, float]:
    entries = [part.strip().split(";dur=") for part in response.headers["server-timing"].split(",")]
    return {name: float(value) for name, value in entries}


def test_every_stage_is_recorded_for_every_api_and_they_sum_to_the_total(staged: GrpcServer) -> None:
    url = staged.http.url
    before = scrape(url, "digits")
    png = digit_png(3)[0]
    sent = {"http": 0, "grpc": 0}
    with httpx.Client(base_url=url, timeout=30) as http:
        for _ in range(3):  # the image API, raw and multipart
            r = http.post("/v1/models/digits/classify", content=png, headers={"content-type": "image/png"})
            assert r.status_code == 200
            r = http.post("/v1/models/digits/classify", files=[("a", ("a.png", png)), ("b", ("b.png", png))])
            assert r.status_code == 200
            sent["http"] += 2
    triton = tgrpc.InferenceServerClient(staged.target)
    pixels = np.random.default_rng(0).integers(0, 256, (2, 3, 32, 32), dtype=np.uint8)
    for _ in range(3):  # v2 over gRPC: encoded images, and a preprocessed tensor
        triton.infer("digits", [images_input([png])])
        triton.infer("digits", [pixels_input(pixels)])
        sent["grpc"] += 2
    triton_http = thttp.InferenceServerClient(url.removeprefix("http://"))
    for _ in range(2):  # v2 over HTTP, the binary extension
        tensor = thttp.InferInput("IMAGE", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([png], dtype=np.object_))
        triton_http.infer("digits", [tensor])
        sent["http"] += 1
    after = scrape(url, "digits")
    for protocol, n in sent.items():
        for stage in STAGES:
            key = f"visionserve_stage_duration_seconds_count|{stage}|{protocol}"
            assert after[key] - before.get(key, 0.0) == n, (protocol, stage)
        stage_sum = sum(
            after[f"visionserve_stage_duration_seconds_sum|{s}|{protocol}"]
            - before.get(f"visionserve_stage_duration_seconds_sum|{s}|{protocol}", 0.0)
            for s in STAGES
        )
        key = f"visionserve_request_duration_seconds_sum||{protocol}"
        total = after[key] - before.get(key, 0.0)
        assert total > 0
        assert stage_sum == pytest.approx(total, abs=n * SUM_TOLERANCE_S), protocol


@pytest.mark.parametrize("multipart", [False, True])
def test_server_timing_names_every_stage_and_they_sum_to_its_total(staged: GrpcServer, multipart: bool) -> None:
    png = digit_png(5)[0]
    with httpx.Client(base_url=staged.http.url, timeout=30) as http:
        if multipart:
            r = http.post("/v1/models/digits/classify", files=[("f", ("f.png", png))])
        else:
            r = http.post("/v1/models/digits/classify", content=png, headers={"content-type": "image/png"})
    assert r.status_code == 200
    timing = header_stages(r)
    assert set(STAGES) <= set(timing)
    assert all(timing[s] >= 0 for s in STAGES)
    assert sum(timing[s] for s in STAGES) == pytest.approx(timing["total"], abs=HEADER_TOLERANCE_MS)


def test_a_request_refused_by_its_image_has_no_stages_but_is_counted(staged: GrpcServer) -> None:
    with httpx.Client(base_url=staged.http.url, timeout=30) as http:
        r = http.post("/v1/models/digits/classify", content=b"not an image", headers={"content-type": "image/png"})
    assert r.status_code == 400
    assert "read" not in header_stages(r)  # it never reached the engine: no stages to report


def test_compute_and_waiting_for_the_instance_are_told_apart(staged: GrpcServer) -> None:
    """A request sent while the paced model's one instance computes another (seen in its metrics) waits for the
    instance, not for a batch (max_queue_delay_ms = 0), then computes for PACED_MS itself."""
    png = digit_png(1)[0]

    def send() -> httpx.Response:
        with httpx.Client(base_url=staged.http.url, timeout=30) as http:
            return http.post("/v1/models/paced/classify", content=png, headers={"content-type": "image/png"})

    with busy_model(staged.http.url, "paced", send) as first:
        second = send()
    assert first.result().status_code == 200 and second.status_code == 200
    alone, waited = header_stages(first.result()), header_stages(second)
    assert alone["compute"] >= PACED_MS and waited["compute"] >= PACED_MS
    assert waited["instance_wait"] > 0
    assert waited["instance_wait"] > waited["batch_wait"]  # the instance, busy for up to PACED_MS, was the wait


def test_waiting_for_a_batch_to_fill_is_batch_wait(staged: GrpcServer) -> None:
    """One request alone to a model that waits GATHER_MS for more: the wait is batch_wait (the instance was
    free), and the metrics say so too."""
    before = scrape(staged.http.url, "gathering")
    with httpx.Client(base_url=staged.http.url, timeout=30) as http:
        r = http.post("/v1/models/gathering/classify", content=digit_png(2)[0], headers={"content-type": "image/png"})
    assert r.status_code == 200
    timing = header_stages(r)
    assert timing["batch_wait"] >= GATHER_MS * 0.99  # the delay runs from the item's arrival in the batcher
    assert timing["instance_wait"] < GATHER_MS / 4
    means = stage_means_ms(before, scrape(staged.http.url, "gathering"), "http")
    assert means["batch_wait"] >= GATHER_MS * 0.99


def test_the_adaptive_policy_does_not_wait_out_the_delay_with_an_instance_idle(staged: GrpcServer) -> None:
    """The same settings as ``gathering`` with ``batch_policy = "adaptive"`` (the default): a lone image is computed
    at once (nothing says waiting would pay), so the setting is not ignored."""
    with httpx.Client(base_url=staged.http.url, timeout=30) as http:
        answers = [
            http.post("/v1/models/adaptive/classify", content=digit_png(k)[0], headers={"content-type": "image/png"})
            for k in range(3)
        ]
    assert [r.status_code for r in answers] == [200, 200, 200]
    for r in answers:
        assert header_stages(r)["batch_wait"] < GATHER_MS / 2
