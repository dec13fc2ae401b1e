"""Many models on one device, against real servers over HTTP and gRPC: an on-demand model loads on its first request
(concurrent first requests share one load), the least recently used goes when a load needs room, never a pinned
model and never a busy one (held busy by ``[faults] delay_ms``); nothing evictable is a 503 at once, a model larger
than the budget is refused with its size, an unload during traffic loses nothing, and the index, metadata and
metrics agree on what is resident. Each model's size is set by its config (``[faults] resident_bytes``), so the
budget holds exactly what the test says whatever the machine measures."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as tgrpc

from service import launcher
from service.launcher import RunningServer
from tests.http import conftest as servers
from tests.http.conftest import ADMIN_TOKEN, metric_value
from tests.http.test_image_api import digit_png

pytestmark = pytest.mark.slow
MB = 1_000_000
ON_DEMAND = 'residency = "on_demand"\n'


def config(*, on_demand: bool = True, size_mb: int = 100, extra: str = "", faults: str = "") -> str:
    head = ON_DEMAND if on_demand else ""
    size = size_mb * MB
    return f"{head}max_batch_size = 1\nmax_queue_delay_ms = 0\n{extra}[faults]\nresident_bytes = {size}\n{faults}"


def repository(root: Path, digits: Path, models: dict[str, str]) -> Path:
    for name, text in models.items():
        shutil.copytree(digits / "digits", root / name)
        (root / name / "config.toml").write_text(text)
    return root


def classify(url: str, model: str, timeout_s: float = 60) -> httpx.Response:
    png, _ = digit_png(0)
    return httpx.post(f"{url}/v1/models/{model}/classify", content=png, headers={"Content-Type": "image/png"},
                      timeout=timeout_s)  # fmt: skip


def cold(response: httpx.Response) -> bool:
    return "cold_start;dur=" in response.headers.get("server-timing", "")


def index(url: str) -> dict[str, dict[str, object]]:
    rows = httpx.post(url + "/v2/repository/index", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).json()
    return {r["name"]: r for r in rows}


def params(server: RunningServer, model: str) -> dict[str, Any]:
    return dict(httpx.get(f"{server.url}/v2/models/{model}").json()["parameters"])


def eventually(server: RunningServer, read: Callable[[], Any], ok: Callable[[Any], bool], what: str) -> Any:
    """``read()`` once ``ok`` holds of it: a front end's catalog follows the engine's within a beat."""
    seen: list[Any] = []
    launcher.wait_until(server, lambda: ok(seen.append(read()) or seen[-1]), 10.0, what)
    return seen[-1]


def resident(url: str) -> set[str]:
    """The models in memory: on-demand ones say so in the index; a pinned one is resident while READY."""
    return {name for name, row in index(url).items() if row.get("resident", row["state"] == "READY")}


@pytest.fixture(scope="module")
def lru(digits_export: Path, tmp_path_factory: pytest.TempPathFactory) -> RunningServer:
    """Budget 250 MB: the pinned model (40 MB) and two of the 100 MB on-demand ones."""
    root = tmp_path_factory.mktemp("many")
    repository(root, digits_export, {
        "pinned": config(on_demand=False, size_mb=40),
        "a": config(extra="queue_full_status = 429\n"),  # its queue's status, never a budget refusal's
        "b": config(faults="load_delay_ms = 1000\n"), "c": config(),
        "slow": config(faults="delay_ms = 300\n"), "slow2": config(faults="delay_ms = 300\n"),
        "huge": config(size_mb=1000),
    })  # fmt: skip
    log = tmp_path_factory.mktemp("many-log") / "server.log"
    server = launcher.start(root, "--admin-token", ADMIN_TOKEN, "--memory-budget", "cpu=250MB",
                            "--min-residency-s", "0", log=log, grpc_port=launcher.free_port())  # fmt: skip
    yield server
    launcher.stop(server)


def test_on_demand_models_are_listed_but_not_resident_until_their_first_request(lru: RunningServer) -> None:
    rows = index(lru.url)
    assert rows["a"]["state"] == "AVAILABLE" and rows["a"]["resident"] is False
    assert "first request" in str(rows["a"]["reason"]) and rows["pinned"] == {
        "name": "pinned",
        "version": "1",
        "state": "READY",
    }  # Triton's row
    meta = httpx.get(lru.url + "/v2/models/a").json()["parameters"]
    assert meta["residency"] == "on_demand" and meta["resident"] is False and meta["state"] == "AVAILABLE"
    assert httpx.get(lru.url + "/v2/models/a/ready").status_code == 200  # it serves: its next request loads it

    first, second = classify(lru.url, "a"), classify(lru.url, "a")
    assert first.status_code == second.status_code == 200, first.text
    assert cold(first) and not cold(second)
    meta = eventually(lru, lambda: params(lru, "a"), lambda m: m["resident"], "a resident in its metadata")
    assert meta["resident"] is True and meta["resident_bytes"] == 100 * MB and meta["state"] == "READY"
    assert metric_value(lru.url, "visionserve_model_loads_total", model="a", reason="on_demand") == 1
    assert metric_value(lru.url, "visionserve_cold_start_duration_seconds_count", model="a") == 1


def test_concurrent_first_requests_share_one_load(lru: RunningServer) -> None:
    with ThreadPoolExecutor(6) as pool:  # b loads in 1 s (its config): the six arrive during the one load
        answers = list(pool.map(lambda _: classify(lru.url, "b"), range(6)))
    assert [r.status_code for r in answers] == [200] * 6
    waited = sum(cold(r) for r in answers)  # on a machine slow to start six threads, a last one may find it loaded
    assert waited >= 2 and metric_value(lru.url, "visionserve_model_residency_misses_total", model="b") == waited
    assert metric_value(lru.url, "visionserve_model_loads_total", model="b") == 1


def test_the_least_recently_used_goes_never_a_busy_or_pinned_one(lru: RunningServer) -> None:
    for model in ("a", "b"):
        assert classify(lru.url, model).status_code == 200
    assert resident(lru.url) == {"pinned", "a", "b"}
    assert classify(lru.url, "slow").status_code == 200  # needs room: a is the least recently used
    assert resident(lru.url) == {"pinned", "b", "slow"}
    assert metric_value(lru.url, "visionserve_model_evictions_total", model="a", reason="lru") >= 1

    with ThreadPoolExecutor(5) as pool:  # slow is busy for over a second (300 ms a batch, batches of one)
        busy = [pool.submit(classify, lru.url, "slow") for _ in range(4)]
        servers.wait_for_metric(lru.url, "visionserve_queue_depth", 1, model="slow")
        assert classify(lru.url, "c").status_code == 200  # evicts b (idle), never slow (busy)
        assert resident(lru.url) == {"pinned", "slow", "c"}
        assert [f.result().status_code for f in busy] == [200] * 4
    assert metric_value(lru.url, "visionserve_model_evictions_total", model="pinned") == 0
    assert metric_value(lru.url, "visionserve_model_evictions_total", model="slow") == 0


def test_nothing_evictable_is_a_503_at_once_and_a_model_over_the_budget_is_refused_with_its_size(
    lru: RunningServer,
) -> None:
    huge = classify(lru.url, "huge")
    assert huge.status_code == 503 and "needs 1.00 GB" in huge.text and "250.0 MB" in huge.text, huge.text
    meta = eventually(lru, lambda: params(lru, "huge"), lambda m: m["why_not_resident"].startswith("refused"),
                      "huge's refusal in its metadata")  # fmt: skip
    assert "1.00 GB" in meta["why_not_resident"]

    for model in ("slow", "slow2"):
        assert classify(lru.url, model).status_code == 200
    assert resident(lru.url) == {"pinned", "slow", "slow2"}
    with ThreadPoolExecutor(8) as pool:  # both on-demand residents busy (300 ms a batch): nothing may go for a
        busy = [pool.submit(classify, lru.url, m) for m in ("slow", "slow2") * 4]
        for model in ("slow", "slow2"):
            servers.wait_for_metric(lru.url, "visionserve_queue_depth", 1, model=model)
        started = time.monotonic()
        refused = classify(lru.url, "a")
        waited = time.monotonic() - started
        assert [f.result().status_code for f in busy] == [200] * 8
    assert refused.status_code == 503 and refused.headers.get("retry-after"), refused.text
    assert "memory budget of 250.0 MB is full" in refused.text and waited < 0.6, (refused.text, waited)


def test_an_unload_during_traffic_loses_nothing_and_the_next_request_loads_again(lru: RunningServer) -> None:
    assert classify(lru.url, "c").status_code == 200
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    with ThreadPoolExecutor(6) as pool:
        answers = [pool.submit(classify, lru.url, "c") for _ in range(12)]
        unload = httpx.post(lru.url + "/v2/repository/models/c/unload", headers=auth, timeout=60)
        assert unload.status_code == 200, unload.text
        assert [f.result().status_code for f in answers] == [200] * 12
    assert metric_value(lru.url, "visionserve_model_evictions_total", model="c", reason="unload") == 1
    assert classify(lru.url, "c").status_code == 200


def test_a_first_request_over_grpc_loads_the_model_too(lru: RunningServer) -> None:
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    httpx.post(lru.url + "/v2/repository/models/a/unload", headers=auth, timeout=60).raise_for_status()
    client = tgrpc.InferenceServerClient(lru.grpc_target)
    shape = httpx.get(lru.url + "/v2/models/a").json()["inputs"][0]["shape"][1:]
    pixels = np.zeros((1, *shape), dtype=np.uint8)
    tensor = tgrpc.InferInput("INPUT", list(pixels.shape), "UINT8")
    tensor.set_data_from_numpy(pixels)
    result = client.infer("a", [tensor])
    assert result.as_numpy("LOGITS").shape == (1, 10)
    assert client.is_model_ready("a")
    assert metric_value(lru.url, "visionserve_model_loads_total", model="a", reason="on_demand") >= 2
    eventually(lru, lambda: params(lru, "a"), lambda m: m["resident"], "a resident after its gRPC request")


def test_the_index_metadata_and_metrics_agree_on_what_is_resident(lru: RunningServer) -> None:
    def disagreements() -> list[str]:
        rows, out = index(lru.url), []
        listed = {m["name"]: m for m in httpx.get(lru.url + "/v1/models").json()}
        for name, row in rows.items():
            meta = params(lru, name)
            size = metric_value(lru.url, "visionserve_model_resident_bytes", model=name)
            if not row.get("resident", row["state"] == "READY") is meta["resident"] is listed[name]["resident"]:
                out.append(f"{name}: index {row['resident']}, metadata {meta['resident']}, /v1/models differ")
            if size != (meta["resident_bytes"] if meta["resident"] else 0):
                out.append(f"{name}: metric {size}, metadata {meta['resident_bytes']}")
        return out

    assert eventually(lru, disagreements, lambda found: not found, "consistent") == []
    charged = metric_value(lru.url, "visionserve_model_resident_bytes")
    assert metric_value(lru.url, "visionserve_device_resident_bytes", device="cpu") == charged <= 250 * MB
    assert metric_value(lru.url, "visionserve_memory_budget_bytes", device="cpu") == 250 * MB
