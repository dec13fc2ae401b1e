"""A real server process with gRPC on (its own free port), serving the HTTP tests' repository."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from service.core.protocol import method_path, pb
from tests.http.conftest import ADMIN_TOKEN, RunningServer, free_port, served_repo, start_server, stop_server

__all__ = ["ADMIN_TOKEN", "GrpcServer", "served_repo"]


@dataclass
class GrpcServer:
    """The server's HTTP side (``http.url``) and its gRPC address (``target``, host:port)."""

    http: RunningServer
    target: str

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.target)


def wait_for_grpc(target: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
        ready = channel.unary_unary(
            method_path("ServerReady"),
            request_serializer=pb.ServerReadyRequest.SerializeToString,
            response_deserializer=pb.ServerReadyResponse.FromString,
        )
        while time.monotonic() < deadline:
            try:
                if ready(pb.ServerReadyRequest(), timeout=2).ready:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise RuntimeError(f"gRPC at {target} not ready in {timeout_s} s")


@pytest.fixture(scope="session")
def both(served_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GrpcServer]:
    """One server for the gRPC and conformance tests: admin on, 4 images and 1 MiB per request at most."""
    log = tmp_path_factory.mktemp("grpc-logs") / "server.log"
    port = free_port()
    running = start_server(
        served_repo, log, "--grpc-port", str(port), "--admin-token", ADMIN_TOKEN, "--max-images", "4",
        "--max-body-mb", "1",
    )  # fmt: skip
    try:
        target = f"127.0.0.1:{port}"
        wait_for_grpc(target)
        yield GrpcServer(running, target)
    finally:
        stop_server(running)
