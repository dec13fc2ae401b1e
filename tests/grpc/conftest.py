"""A real server process with gRPC on (its own free port), serving the HTTP tests' repository."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from service.core.protocol import method_path, pb
from service.core.settings import ServerSettings
from service.inprocess import InProcessServer
from tests.http.conftest import ADMIN_TOKEN

__all__ = ["ADMIN_TOKEN", "GrpcServer"]


@dataclass
class GrpcServer:
    """The server's HTTP side (``http.url``) and its gRPC address (``target``, host:port)."""

    http: InProcessServer
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
    """One server for the gRPC and conformance tests (admin on, 4 images and 1 MiB per request at most): the front
    end and its engine in this process, with HTTP and gRPC on free ports, so tritonclient's three clients talk to
    it unchanged. The gRPC tests that are about processes start ``visionserve serve`` (tests/grpc/test_stages.py)."""
    settings = ServerSettings(
        repository=str(served_repo), port=0, grpc_port=0, admin_token=ADMIN_TOKEN, max_images_per_request=4,
        max_body_bytes=1024 * 1024, state_dir=str(tmp_path_factory.mktemp("state")),
    )  # fmt: skip
    with InProcessServer(settings, grpc=True) as running:
        wait_for_grpc(running.grpc_target)
        yield GrpcServer(running, running.grpc_target)
