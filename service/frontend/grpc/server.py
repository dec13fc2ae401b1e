"""Starting and stopping the gRPC server beside HTTP, in the same process and event loop."""

from __future__ import annotations

import logging

import grpc

from service.core.errors import ConfigError
from service.frontend.grpc.servicer import InferenceServicer
from service.frontend.state import ServerState

log = logging.getLogger("visionserve.grpc")


class GrpcHandle:
    """A running gRPC server (or none, with ``--grpc-port 0``); ``stop`` lets calls in flight finish first."""

    def __init__(self, server: grpc.aio.Server | None = None, address: str = "") -> None:
        self._server = server
        self.address = address

    async def stop(self, grace_s: float) -> None:
        """Refuse new calls at once, let those in flight finish within ``grace_s``, then cancel the rest."""
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None


def _options(server: ServerState) -> list[tuple[str, int]]:
    return [
        # Several front-end processes bind the same port and the kernel spreads connections among them.
        ("grpc.so_reuseport", 1),
        # The same limit as an HTTP body; grpc refuses a larger message with RESOURCE_EXHAUSTED.
        ("grpc.max_receive_message_length", server.settings.max_body_bytes),
        ("grpc.max_send_message_length", -1),
    ]


async def start_grpc(server: ServerState) -> GrpcHandle:
    """Serve ``inference.GRPCInferenceService`` on ``settings.host:settings.grpc_port`` (0: off)."""
    settings = server.settings
    if settings.grpc_port == 0:
        return GrpcHandle()
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    address = f"{host}:{settings.grpc_port}"
    grpc_server = grpc.aio.server(options=_options(server))
    grpc_server.add_generic_rpc_handlers((InferenceServicer(server).handler(),))
    try:
        port = grpc_server.add_insecure_port(address)
    except RuntimeError as exc:
        raise ConfigError(f"gRPC could not bind {address}: {exc}") from exc
    if port == 0:
        raise ConfigError(f"gRPC could not bind {address} (in use by a process without SO_REUSEPORT?)")
    await grpc_server.start()
    log.info("gRPC (Open Inference Protocol) on %s", address)
    return GrpcHandle(grpc_server, address)
