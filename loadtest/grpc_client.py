"""The load generator's gRPC client: one HTTP/2 channel per process, requests sent as ready-serialised bytes.

Every request body is serialised once, before any clock starts (``loadtest.inputs``), and the answer is not parsed:
like the HTTP client, the generator measures the server, not protobuf. grpc multiplexes all of a process's calls on
one connection, as tritonclient.grpc and perf_analyzer do.
"""

from __future__ import annotations

from typing import Any

import grpc


def _identity(data: bytes) -> bytes:
    return data


class GrpcClient:
    """``await fetch(path, body, headers)`` returns 200 for OK, else the gRPC status name (``UNAVAILABLE``, ...), no
    header fields (gRPC sends no Server-Timing) and the serialised answer (empty unless OK); raises ``TimeoutError``
    when ``timeout_s`` passes. ``path`` is the RPC's path, ``headers`` its metadata."""

    def __init__(self, target: str, timeout_s: float) -> None:
        self.target = target.removeprefix("grpc://")
        self.timeout_s = timeout_s
        self._channel: Any = grpc.aio.insecure_channel(
            self.target, options=[("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
        )
        self._calls: dict[str, Any] = {}

    async def fetch(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int | str, dict[str, str], bytes]:
        call = self._calls.get(path)
        if call is None:
            call = self._calls[path] = self._channel.unary_unary(
                path, request_serializer=_identity, response_deserializer=_identity
            )
        try:
            answer = await call(body, timeout=self.timeout_s, metadata=tuple(headers.items()) or None)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and exc.details() == "Deadline Exceeded":
                raise TimeoutError from exc  # the client's own timeout, not the server's DEADLINE_EXCEEDED answer
            return str(exc.code().name), {}, b""
        return 200, {}, bytes(answer)

    async def aclose(self) -> None:
        await self._channel.close()
