"""``visionserve loadtest --protocol grpc`` against a real server: ModelInfer with raw contents, counted alike."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.grpc.conftest import GrpcServer


def loadtest(both: GrpcServer, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "service.cli", "loadtest", "--url", both.http.url, "--grpc-url", both.target,
           "--protocol", "grpc", "--duration", "1", "--warmup", "0.2", "--drain", "5", "--image-size", "64x64",
           "--no-progress", "--json", *extra]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)


def test_closed_loop_over_grpc(both: GrpcServer) -> None:
    run = loadtest(both, "--model", "digits.image", "--concurrency", "2", "--images-per-request", "2")
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert report["protocol"] == "grpc"
    (step,) = report["steps"]
    assert step["requests"] > 0 and step["errors"] == {} and step["images"] == 2 * step["requests"]


def test_an_unknown_model_stops_before_the_load(both: GrpcServer) -> None:
    run = loadtest(both, "--model", "nope", "--concurrency", "1")
    assert run.returncode == 2 and "NOT_FOUND" in run.stderr and "'nope'" in run.stderr, run.stderr
