"""The Ray Serve deployment: a replica is one real visionserve server behind Ray's HTTP proxy, started as a child
process (``child.py``) and sent every request unchanged; its health checks, shutdown and settings: docs/deploy.md
("What a replica is").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import ray
from ray import serve
from ray.serve import Application
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from deploy.ray.child import ReplicaOptions, ServerProcess

log = logging.getLogger(__name__)

REPLICA_HEADER = "x-visionserve-replica"
NODE_HEADER = "x-visionserve-node"  # the Ray node id: which machine answered

# Connection-level headers are the two hops' own business (RFC 9110 section 7.6.1); everything else passes.
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "transfer-encoding",
     "upgrade", "host"}
)  # fmt: skip

# Two full batches of the default max_batch_size (32) per replica, not Ray's target of 2 ongoing requests, which would
# keep every batch at about 2 images; 1.5 times that before Ray queues at the proxy (docs/deploy.md, "Why not Ray's
# defaults").
TARGET_ONGOING_REQUESTS = 64
MAX_ONGOING_REQUESTS = 96
AUTOSCALING = {
    "min_replicas": 1,
    "max_replicas": 4,
    "target_ongoing_requests": TARGET_ONGOING_REQUESTS,
    "upscale_delay_s": 15.0,  # a replica loads and warms its models in seconds to a minute: don't chase spikes
    "downscale_delay_s": 300.0,
    "look_back_period_s": 15.0,
}


class Replica:
    """One replica: a visionserve server as a child process, and a forwarder to it."""

    async def __init__(self, options: dict[str, Any] | ReplicaOptions) -> None:  # type: ignore[misc]
        self.options = options if isinstance(options, ReplicaOptions) else msgspec.convert(options, ReplicaOptions)
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.node = ray.get_runtime_context().get_node_id()
        # Pooled keep-alive connections to the server, as many as Ray lets in (max_ongoing_requests bounds them); no
        # total timeout, since the server enforces its own deadlines (parameters.timeout, default_timeout_ms) and a
        # request may rightly wait in its queue.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=MAX_ONGOING_REQUESTS)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), limits=limits)
        self.server = ServerProcess(self.options)
        self.server.start()
        try:
            await self.server.wait_ready(self.client)
        except BaseException:
            await asyncio.to_thread(self.server.stop)
            raise
        log.info("replica %s: visionserve ready on %s", self.replica, self.server.url)

    async def __call__(self, request: Request) -> Response:
        """Forward one request to this replica's server and stream its answer back."""
        path: bytes = request.scope.get("raw_path") or request.scope["path"].encode()  # as the client sent it
        root = request.scope.get("root_path", "").encode()
        if root and path.startswith(root):  # an application mounted under a route prefix
            path = path[len(root) :] or b"/"
        query = request.scope.get("query_string", b"")
        url = httpx.URL(self.server.url).copy_with(raw_path=path + b"?" + query if query else path)
        headers = [(k, v) for k, v in request.headers.raw if k.decode("latin-1").lower() not in HOP_BY_HOP]
        has_body = request.method not in ("GET", "HEAD") or "content-length" in request.headers
        upstream = self.client.build_request(
            request.method, url, headers=headers, content=request.stream() if has_body else None
        )
        try:
            answer = await self.client.send(upstream, stream=True)
        except httpx.TransportError as exc:
            # The server died or restarts: say so plainly; check_health will have the replica replaced.
            return JSONResponse({"error": f"replica {self.replica}: server unreachable: {exc}"}, status_code=502)
        response = StreamingResponse(_relay(answer), status_code=answer.status_code)
        response.raw_headers = [
            (k.encode("latin-1"), v.encode("latin-1"))
            for k, v in answer.headers.multi_items()
            if k.lower() not in HOP_BY_HOP
        ] + [(REPLICA_HEADER.encode(), self.replica.encode()), (NODE_HEADER.encode(), self.node.encode())]
        return response

    async def check_health(self) -> None:
        """Raise (so Ray replaces this replica) unless the server runs and reports ready."""
        await self.server.check_ready(self.client)

    async def __del__(self) -> None:
        """Drain: SIGTERM the server and wait for it within the bound, then close the connection pool."""
        code = await asyncio.to_thread(self.server.stop)
        log.info("replica %s: visionserve exited with %s", self.replica, code)
        await self.client.aclose()


async def _relay(answer: httpx.Response) -> AsyncIterator[bytes]:
    """The server's body as it comes (still encoded), and its connection back to the pool however the relay ends
    (a client that goes away included)."""
    try:
        async for chunk in answer.aiter_raw():
            yield chunk
    finally:
        await answer.aclose()


# Options a serve.yaml can override per deployment (max_ongoing_requests, autoscaling_config, ray_actor_options,...).
VisionServe = serve.deployment(
    name="visionserve",
    max_ongoing_requests=MAX_ONGOING_REQUESTS,
    autoscaling_config=AUTOSCALING,
    ray_actor_options={"num_cpus": 1},
    health_check_period_s=5.0,
    health_check_timeout_s=10.0,
    # Ray waits for the replica's ongoing requests before __del__; the server's own drain comes after.
    graceful_shutdown_wait_loop_s=1.0,
    graceful_shutdown_timeout_s=30.0,
)(Replica)


def build_app(args: dict[str, Any]) -> Application:
    """The application ``serve run`` builds from serve.yaml's ``args`` (the fields of :class:`ReplicaOptions`)."""
    return VisionServe.bind(msgspec.to_builtins(msgspec.convert(args, ReplicaOptions)))  # checked here, at build
