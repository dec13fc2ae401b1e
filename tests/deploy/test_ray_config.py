"""The Ray Serve deployment's configuration, checked without a cluster: serve.yaml in Ray's own schema, the options
a replica takes, and a replica's server started, checked and drained by the same code a replica runs."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import httpx
import pytest
import yaml

from tests.deploy.conftest import ROOT, quiet_server_args

serve_schema = pytest.importorskip("ray.serve.schema", reason="the ray extra is not installed")

from deploy.ray.app import AUTOSCALING, MAX_ONGOING_REQUESTS, build_app  # noqa: E402
from deploy.ray.child import ReplicaOptions, ServerProcess  # noqa: E402

SERVE_YAML = ROOT / "deploy" / "ray" / "serve.yaml"


def test_serve_yaml_is_valid_ray_serve_config_and_builds_the_app() -> None:
    config = serve_schema.ServeDeploySchema.model_validate(yaml.safe_load(SERVE_YAML.read_text()))
    (app,) = config.applications
    assert app.import_path == "deploy.ray.app:build_app" and app.route_prefix == "/"
    ReplicaOptions(**app.args)  # the args are the replica's options
    assert build_app(app.args) is not None
    (deployment,) = app.deployments
    assert deployment.name == "visionserve"
    # The file and the code's defaults say the same thing about batching and autoscaling.
    assert deployment.max_ongoing_requests == MAX_ONGOING_REQUESTS
    assert deployment.autoscaling_config["target_ongoing_requests"] == AUTOSCALING["target_ongoing_requests"]
    assert deployment.autoscaling_config["target_ongoing_requests"] > 2  # Ray's default starves a batcher


@pytest.mark.parametrize("flag", ["--port", "--host=0.0.0.0", "--workers", "--repository"])
def test_the_replica_owns_where_its_server_listens(flag: str) -> None:
    with pytest.raises(ValueError, match="may not set"):
        ReplicaOptions(repository="model_repository", server_args=(flag, "1"))


@pytest.mark.slow
def test_a_replicas_server_starts_reports_ready_and_drains_to_exit_0(digits_repo: Path, tmp_path: Path) -> None:
    """On KServe's layout too: a folder that is one model's, named by the options."""
    folder = tmp_path / "models"
    shutil.copytree(digits_repo / "digits", folder)
    options = ReplicaOptions(repository=str(folder), model_name="mnist", server_args=quiet_server_args())
    server = ServerProcess(options)

    async def run() -> None:
        async with httpx.AsyncClient() as client:
            await server.wait_ready(client)
            await server.check_ready(client)
            meta = await client.get(server.url + "/v2/models/mnist")
            assert meta.status_code == 200 and meta.json()["name"] == "mnist"

    server.start()
    try:
        asyncio.run(run())
    finally:
        code = server.stop()
    assert code == 0
    with pytest.raises(RuntimeError, match="exited"):
        asyncio.run(_check(server))


async def _check(server: ServerProcess) -> None:
    async with httpx.AsyncClient() as client:
        await server.check_ready(client)
