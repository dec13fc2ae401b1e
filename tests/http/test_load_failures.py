"""Loading never fails silently: a model version whose load raises anything (here a runtime's own exception, not
the project's) is unavailable with its reason in its metadata, the repository index, ``/metrics`` and the log,
while the other models serve; ``--strict-readiness`` keeps readiness false meanwhile; a load that stops half way
stops the engine with a status the supervisor reports, never serving what happened to load before it."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import httpx
import pytest

from service import launcher
from service.core.settings import ServerSettings
from service.engine import process
from tests.http import conftest as servers
from tests.http.conftest import ADMIN_TOKEN, metric_value
from tests.http.test_image_api import digit_png

pytestmark = pytest.mark.slow
BROKEN = '[faults]\nload_error = "no kernel image is available for execution on the device"\n'


@pytest.fixture
def repo(served_repo: Path, tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    shutil.copytree(served_repo / "digits", root / "digits")
    shutil.copytree(served_repo / "digits", root / "broken")
    (root / "broken" / "config.toml").write_text(BROKEN)
    return root


def classify(url: str, model: str = "digits") -> httpx.Response:
    png, _ = digit_png(0)
    return httpx.post(f"{url}/v1/models/{model}/classify", content=png, headers={"Content-Type": "image/png"})


def serves(url: str) -> bool:
    try:
        return classify(url).status_code == 200
    except httpx.TransportError:
        return False


def test_a_model_that_raises_while_loading_is_reported_everywhere_and_the_rest_serve(
    repo: Path, tmp_path: Path
) -> None:
    server = servers.start_server(repo, tmp_path / "server.log", "--admin-token", ADMIN_TOKEN)
    assert classify(server.url).status_code == 200
    meta = httpx.get(server.url + "/v2/models/broken")
    assert meta.status_code == 404, meta.text
    assert "RuntimeError: injected load failure: no kernel image" in meta.json()["error"]
    assert classify(server.url, "broken").status_code == 404
    index = httpx.post(server.url + "/v2/repository/index", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).json()
    (row,) = [r for r in index if r["name"] == "broken"]
    assert row["state"] == "UNAVAILABLE" and "no kernel image" in row["reason"]
    assert metric_value(server.url, "visionserve_model_load_failures_total", model="broken", version="1") == 1
    assert metric_value(server.url, "visionserve_model_load_failures_total", model="digits") == 0
    assert httpx.get(server.url + "/v2/health/ready").status_code == 200  # not strict: ready with what loaded
    assert servers.stop_server(server) == 0
    log = server.tail(100_000)
    assert "broken version 1 failed to load with an unexpected error" in log and "Traceback" in log


def test_strict_readiness_stays_false_while_a_model_failed_to_load(repo: Path, tmp_path: Path) -> None:
    server = launcher.launch(repo, "--strict-readiness", log=tmp_path / "server.log")
    servers._STARTED.append(server)
    # The engine up: digits answers (readiness cannot tell, by design).
    launcher.wait_until(server, lambda: serves(server.url), 120, "serving digits")
    for _ in range(5):
        ready = httpx.get(server.url + "/v2/health/ready")
        assert (ready.status_code, ready.json()) == (400, {"ready": False})
    assert launcher.stop(server) == 0


def test_a_load_that_stops_half_way_stops_the_engine_non_zero(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken_load(self: object) -> None:
        raise ModuleNotFoundError("No module named 'torch'")

    monkeypatch.setattr(process.EngineServer, "load_all", broken_load)
    settings = ServerSettings(repository=str(tmp_path), grpc_port=0)
    launch = process.EngineLaunch(settings=settings, name="engine0", endpoint=f"ipc://{tmp_path}/engine-0")
    with pytest.raises(SystemExit) as stopped:
        asyncio.run(process.run_engine(launch))
    assert stopped.value.code == process.LOAD_FAILED_EXIT != 0
    assert not (tmp_path / "engine-0").exists()  # never bound: no front end could reach what half loaded
