"""A digits model repository for the deployment tests, and the server flags every test server needs."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import copy_model

# Ray reads this when it is first imported, so it is set here, before any test module imports ray. FACTS.md: without
# it Ray gives every node of a local cluster the machine's outward address rather than 127.0.0.1.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


@functools.cache
def quiet_server_args() -> tuple[str, ...]:
    """``--grpc-port 0`` where the server has a gRPC front end (it would bind 8001 in every test server)."""
    out = subprocess.run(
        [sys.executable, "-m", "service.cli", "serve", "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    return ("--grpc-port", "0") if "--grpc-port" in out.stdout else ()


@pytest.fixture(scope="session")
def digits_repo(digits_export: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``digits`` (trained; served from its ONNX artifact), in a repository of models."""
    return copy_model(digits_export, tmp_path_factory.mktemp("deploy-repo"))


def successes(metrics_text: str, model: str) -> float:
    """``visionserve_requests_total{outcome="success"}`` for ``model``, summed over versions and devices."""
    total = 0.0
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if (
                sample.name == "visionserve_requests_total"
                and sample.labels.get("model") == model
                and sample.labels.get("outcome") == "success"
            ):
                total += sample.value
    return total
