"""Metrics: after a known mix of good, bad, rejected and timed-out requests against a real server, every counter
and histogram count equals what was sent; a stream's frames, by outcome, and their ages equal what its client was
answered, and the open streams go up and down; the dashboard queries only metrics the server exports, and has a
panel for each metric of many models on one device, of rollouts and of streams."""

from __future__ import annotations

import concurrent.futures
import json
import re
import shutil
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.core.metrics import GPU_METRIC_NAMES
from service.inprocess import InProcessServer
from tests.conftest import encode_image, random_image
from tests.http.conftest import RunningServer, busy_model, slow_config, start_server, stop_server
from tests.http.test_image_api import digit_png

ROOT = Path(__file__).resolve().parents[2]
# service/core/memory_metrics.py: exported by every server (no on-demand model needed), each queried by a panel.
RESIDENCY_METRICS = {
    "visionserve_model_resident_bytes", "visionserve_device_resident_bytes", "visionserve_memory_budget_bytes",
    "visionserve_model_loads_total", "visionserve_model_evictions_total", "visionserve_model_residency_hits_total",
    "visionserve_model_residency_misses_total", "visionserve_cold_start_duration_seconds",
}  # fmt: skip
# service/core/rollout_metrics.py: exported by every server (families without samples when no rollout runs).
ROLLOUT_METRICS = {
    "visionserve_rollout_info", "visionserve_rollout_agreement", "visionserve_rollout_topk_overlap",
    "visionserve_rollout_latency_ratio", "visionserve_rollout_fraction", "visionserve_rollout_samples_total",
    "visionserve_rollout_score_shift",
}  # fmt: skip
# service/core/stream_metrics.py: exported by every server (families without samples before any stream).
STREAM_METRICS = {"visionserve_stream_frames_total", "visionserve_stream_age_seconds", "visionserve_streams_open"}


def scrape(server: InProcessServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:  # type: ignore[type-arg]
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


@pytest.fixture(scope="module")
def fresh(served_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A server of its own, so the counters start from zero."""
    root = tmp_path_factory.mktemp("metrics-repo")
    for name in ("digits", "slow"):
        shutil.copytree(served_repo / name, root / name)
    shutil.copytree(served_repo / "digits", root / "live")  # streamed to: its counts apart from digits'
    (root / "slow" / "config.toml").write_text(slow_config(max_queue_size=2))
    running = start_server(root, tmp_path_factory.mktemp("logs") / "metrics.log")
    yield running
    stop_server(running)


def test_counters_and_histograms_equal_what_was_sent(fresh: RunningServer) -> None:
    good, _ = digit_png(0)
    pixels = np.random.default_rng(0).integers(0, 256, (2, 3, 32, 32), dtype=np.uint8)
    with fresh.client() as c:
        for _ in range(5):
            assert (
                c.post("/v1/models/digits/classify", content=good, headers={"content-type": "image/png"}).status_code
                == 200
            )
        for _ in range(3):
            assert (
                c.post("/v1/models/digits/classify", content=b"junk", headers={"content-type": "image/png"}).status_code
                == 400
            )
        for _ in range(2):
            body = {"inputs": [{"name": "INPUT", "datatype": "UINT8", "shape": [2, 3, 32, 32],
                                "data": pixels.ravel().tolist()}]}  # fmt: skip
            assert c.post("/v2/models/digits/infer", json=body).status_code == 200

    image = encode_image(random_image(224, 224), "JPEG")

    def slow(_: int) -> int:
        with fresh.client() as c:
            return c.post("/v1/models/slow/classify", content=image, headers={"content-type": "image/jpeg"}).status_code

    with busy_model(fresh.url, "slow", lambda: slow(0)) as first, concurrent.futures.ThreadPoolExecutor(10) as pool:
        rest = list(pool.map(slow, range(10)))  # ten at once while the instance is busy
        flood = [first.result(), *rest]
    ok, rejected = flood.count(200), flood.count(503)
    assert ok + rejected == 11 and rejected > 0

    with busy_model(fresh.url, "slow", lambda: slow(0)) as busy:
        tensor = {"name": "INPUT", "datatype": "UINT8", "shape": [1, 3, 224, 224],
                  "parameters": {"binary_data_size": 3 * 224 * 224}}  # fmt: skip
        head = json.dumps({"parameters": {"timeout": 1}, "inputs": [tensor]}).encode()
        with fresh.client() as c:
            late = c.post("/v2/models/slow/infer", content=head + bytes(3 * 224 * 224),
                          headers={"Inference-Header-Content-Length": str(len(head))})  # fmt: skip
        assert busy.result() == 200
    assert late.status_code == 504

    m = scrape(fresh)
    digits = {"model": "digits", "version": "1"}
    slow_labels = {"model": "slow", "version": "1"}
    assert value(m, "visionserve_requests_total", outcome="success", **digits) == 7
    assert value(m, "visionserve_requests_total", outcome="bad_input", **digits) == 3
    assert value(m, "visionserve_requests_total", outcome="success", **slow_labels) == ok + 1
    assert value(m, "visionserve_requests_total", outcome="rejected", **slow_labels) == rejected
    assert value(m, "visionserve_requests_total", outcome="timeout", **slow_labels) == 1
    assert value(m, "visionserve_request_duration_seconds_count", **digits) == 10
    assert value(m, "visionserve_request_duration_seconds_count", **slow_labels) == 11 + 2
    assert value(m, "visionserve_preprocess_duration_seconds_count", **digits) == 5 + 3  # the raw images decoded
    assert value(m, "visionserve_queue_duration_seconds_count", **digits) == 7
    assert value(m, "visionserve_images_total", **digits) == 5 + 2 * 2
    assert value(m, "visionserve_images_total", **slow_labels) == ok + 1
    # The batch-size histogram agrees with the batch and image counters, and with the batcher's own record.
    batches = value(m, "visionserve_batches_total", **digits)
    assert value(m, "visionserve_batch_size_count", **digits) == batches
    assert value(m, "visionserve_batch_size_sum", **digits) == 9
    assert value(m, "visionserve_compute_duration_seconds_count", **digits) == batches
    stats = httpx.get(fresh.url + "/v2/models/digits/stats").json()["model_stats"][0]
    record = {b["batch_size"]: b["compute_infer"]["count"] for b in stats["batch_stats"]}
    assert stats["execution_count"] == batches and sum(record.values()) == batches
    assert sum(size * n for size, n in record.items()) / batches == pytest.approx(9 / batches)
    assert stats["inference_stats"]["success"]["count"] == 7 and stats["inference_count"] == 9
    assert (
        value(m, "visionserve_queue_depth", **digits) == 0 and value(m, "visionserve_inflight_batches", **digits) == 0
    )


def test_the_dashboard_queries_only_exported_metrics(fresh: RunningServer) -> None:
    dashboard = json.loads((ROOT / "docs" / "grafana" / "visionserve.json").read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]  # a row has none
    queries += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    queried = {re.sub(r"_(bucket|count|sum)$", "", name) for q in queries for name in re.findall(r"visionserve_\w+", q)}
    httpx.post(fresh.url + "/v1/models/digits/classify", content=digit_png(0)[0], headers={"content-type": "image/png"})
    families = list(text_string_to_metric_families(httpx.get(fresh.url + "/metrics").text))
    exported = {f.name + ("_total" if f.type == "counter" else "") for f in families}  # samples or not yet
    missing = {q for q in queried if q not in exported and q not in GPU_METRIC_NAMES}
    assert not missing, f"the dashboard queries metrics the server does not export: {missing}"
    assert len(queried) >= 12
    assert not RESIDENCY_METRICS - exported, f"not exported: {RESIDENCY_METRICS - exported}"
    assert not RESIDENCY_METRICS - queried, f"no dashboard panel queries {RESIDENCY_METRICS - queried}"
    assert not ROLLOUT_METRICS - exported, f"not exported: {ROLLOUT_METRICS - exported}"
    assert not ROLLOUT_METRICS - queried, f"no dashboard panel queries {ROLLOUT_METRICS - queried}"
    assert not STREAM_METRICS - exported, f"not exported: {STREAM_METRICS - exported}"
    assert not STREAM_METRICS - queried, f"no dashboard panel queries {STREAM_METRICS - queried}"


def frame(frame_id: int, image: bytes, ts: float | None = None) -> bytes:
    """A stream's binary frame (docs/streams.md): the header's length, the header, the image."""
    header = json.dumps({"id": frame_id, "ts": ts}).encode()
    return struct.pack(">I", len(header)) + header + image


def test_stream_frames_their_ages_and_open_streams_are_counted(fresh: RunningServer) -> None:
    from websockets.sync.client import connect

    live = {"model": "live"}
    png = digit_png(3)[0]
    burst = [frame(i, png) for i in range(1, 7)] + [b"\x00\x00\x00\x05nope!", frame(7, b"not an image")]
    answers = []
    url = fresh.url.replace("http://", "ws://", 1) + "/v1/models/live/stream?max_age_ms=30000&top_k=3"
    with connect(url, open_timeout=30) as socket:
        socket.send(frame(0, png, 12.5))
        answers.append(json.loads(socket.recv(timeout=30)))
        assert answers[0]["status"] == "result" and answers[0]["ts"] == 12.5, answers
        for message in burst:  # at once: frames that wait while another computes are superseded
            socket.send(message)
        while len(answers) < 1 + len(burst):
            answers.append(json.loads(socket.recv(timeout=30)))
        m = scrape(fresh)
        assert value(m, "visionserve_streams_open", **live) == 1
    told = {o: 0 for o in ("answered", "superseded", "expired", "error")}
    for answer in answers:
        told["answered" if answer["status"] == "result" else answer["status"]] += 1
    assert told["error"] == 2, answers  # the header that is no JSON, and the image that is none
    counted = {o: value(m, "visionserve_stream_frames_total", outcome=o, **live) for o in told}
    assert counted == told and sum(counted.values()) == 1 + len(burst)
    ages = [a["age_ms"] / 1000.0 for a in answers if a["status"] == "result"]
    assert value(m, "visionserve_stream_age_seconds_count", **live) == len(ages)
    assert value(m, "visionserve_stream_age_seconds_bucket", le="+Inf", **live) == len(ages)
    assert value(m, "visionserve_stream_age_seconds_sum", **live) == pytest.approx(sum(ages), abs=1e-5)

    deadline = time.monotonic() + 30
    while (shown := value(scrape(fresh), "visionserve_streams_open", **live)) and time.monotonic() < deadline:
        time.sleep(0.1)  # the server ends the session after the client has closed
    assert shown == 0
    assert {o: value(scrape(fresh), "visionserve_stream_frames_total", outcome=o, **live) for o in told} == told


def test_every_response_has_a_request_id_and_the_json_access_log_has_the_split(
    served_repo: Path, tmp_path: Path
) -> None:
    root = tmp_path / "repo"
    shutil.copytree(served_repo / "digits", root / "digits")
    log = tmp_path / "server.log"
    server = start_server(root, log, "--log-format", "json")
    try:
        r = httpx.post(server.url + "/v1/models/digits/classify", content=digit_png(0)[0],
                       headers={"content-type": "image/png", "X-Request-Id": "req-42"})  # fmt: skip
        assert r.headers["x-request-id"] == "req-42"
        assert len(httpx.get(server.url + "/v2/health/live").headers["x-request-id"]) == 32
    finally:
        stop_server(server)
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    mine = next(line for line in lines if line["request_id"] == "req-42")
    assert mine["status"] == 200 and mine["path"] == "/v1/models/digits/classify"
    assert mine["compute_ms"] > 0 and mine["preprocess_ms"] > 0 and mine["duration_ms"] >= mine["compute_ms"]


def test_metrics_can_be_turned_off(served_repo: Path, tmp_path: Path) -> None:
    root = tmp_path / "repo"
    shutil.copytree(served_repo / "digits", root / "digits")
    server = start_server(root, tmp_path / "server.log", "--no-metrics")
    try:
        assert httpx.get(server.url + "/metrics").status_code == 404
        ok = httpx.post(server.url + "/v1/models/digits/classify", content=digit_png(0)[0],
                        headers={"content-type": "image/png"})  # fmt: skip
        assert ok.status_code == 200
    finally:
        stop_server(server)
