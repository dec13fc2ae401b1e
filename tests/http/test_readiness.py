"""Readiness that means it: ``/v2/health/ready`` is true only once every front end can reach its engine, and a
front end accepts connections only then, so a load balancer (or the launcher) that sees 200 never meets a 503."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from service import launcher
from tests.http import conftest as servers
from tests.http.test_image_api import digit_png

pytestmark = pytest.mark.slow

# KServe's Python client cannot share a process with tritonclient's gRPC module (both register the protocol's
# messages, package "inference", in protobuf's default pool): it runs in a child interpreter of its own.
KSERVE_CLIENT = """
import asyncio, json, sys
import numpy as np
from kserve import InferenceRESTClient, InferInput, InferRequest, RESTConfig

async def main(url):
    client = InferenceRESTClient(RESTConfig(protocol="v2", timeout=30))
    image = InferInput("IMAGE", [1], "BYTES")
    image.set_data_from_numpy(np.array([open(sys.argv[2], "rb").read()], dtype=np.object_), binary_data=True)
    request = InferRequest(model_name="digits", infer_inputs=[image], request_id="k1")
    response = await client.infer(url, request, model_name="digits", headers=None, is_graph_endpoint=False)
    out = {
        "live": await client.is_server_live(url),
        "ready": await client.is_server_ready(url),
        "model_ready": await client.is_model_ready(url, "digits"),
        "outputs": [(o.name, o.shape) for o in response.outputs],
    }
    await client.close()
    print(json.dumps(out))

asyncio.run(main(sys.argv[1]))
"""


def test_no_503_after_the_first_ready_with_four_front_ends(served_repo: Path, tmp_path: Path) -> None:
    """Polled from the first accepted connection: once ready has said 200, every inference on a new connection
    (so on any of the four front ends) is answered 200."""
    root = tmp_path / "repo"
    shutil.copytree(served_repo / "digits", root / "digits")
    server = launcher.launch(root, "--workers", "4", log=tmp_path / "server.log")
    servers._STARTED.append(server)  # stopped with the test, whatever happens
    launcher.wait_until(server, lambda: launcher.is_ready(server.url, timeout_s=2), 120, "ready")
    image, _ = digit_png(3)
    codes = []
    for _ in range(60):  # a new connection each: the kernel hands them to whichever front end accepts
        response = httpx.post(
            server.url + "/v1/models/digits/classify", content=image, headers={"Content-Type": "image/png"}, timeout=30
        )
        codes.append(response.status_code)
    assert codes == [200] * len(codes), [c for c in codes if c != 200]
    assert len(server.roles()["frontend"]) == 4
    assert launcher.stop(server) == 0


def test_kserves_own_client_reads_health_and_infers(server: launcher.RunningServer, tmp_path: Path) -> None:
    image = tmp_path / "digit.png"
    image.write_bytes(digit_png(3)[0])
    done = subprocess.run(
        [sys.executable, "-c", KSERVE_CLIENT, server.url, str(image)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert (out["live"], out["ready"], out["model_ready"]) == (True, True, True)
    assert out["outputs"] == [["LOGITS", [1, 10]]]
