"""Each error class carries its HTTP status, gRPC code and outcome label (service/core/errors.py), and the HTTP and
gRPC front ends answer with exactly those: served for real here, by litestar and by a grpc.aio server."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import grpc
import msgspec
import pytest
from litestar import Litestar, get
from litestar.exceptions import HTTPException
from litestar.params import FromPath
from litestar.testing import TestClient

from service.client import ClientError
from service.core import errors
from service.core.errors import OverloadedError, VisionServeError, outcome_label
from service.core.metrics import OUTCOMES
from service.frontend.grpc.servicer import _guarded, code_of
from service.frontend.http.errors import handle_http, handle_ours, handle_unexpected
from service.transport.messages import WireError

# Every class of the tree, and the client's own error (a VisionServeError too).
TREE = [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, VisionServeError)]
CLASSES = [*TREE, ClientError]
# One instance of each, and an overload answered 429 (a model's queue_full_status).
INSTANCES: list[VisionServeError] = [c("boom") for c in CLASSES] + [OverloadedError("full", http_status=429)]

# google.rpc.Code's HTTP mapping (googleapis/google/rpc/code.proto), which grpc-gateway follows.
CANONICAL_HTTP = {
    "CANCELLED": 499,
    "INVALID_ARGUMENT": 400,
    "DEADLINE_EXCEEDED": 504,
    "NOT_FOUND": 404,
    "PERMISSION_DENIED": 403,
    "RESOURCE_EXHAUSTED": 429,
    "UNAVAILABLE": 503,
    "INTERNAL": 500,
}
# Where HTTP is more precise than gRPC: the code grpc has for the same refusal.
REFINED = {(415, "INVALID_ARGUMENT"), (413, "RESOURCE_EXHAUSTED")}


def label(exc: VisionServeError) -> str:
    return f"{type(exc).__name__}-{exc.http_status}"


def test_the_tree_is_what_the_docstring_draws() -> None:
    doc = errors.__doc__ or ""
    for cls in TREE:
        row = next((line for line in doc.splitlines() if f" {cls.__name__} " in line), None)
        assert row is not None, f"{cls.__name__} is missing from the tree in the docstring"
        assert f" {cls.http_status}  {cls.grpc_code} " in row and f" {cls.outcome} " in row, row


@pytest.mark.parametrize("exc", INSTANCES, ids=label)
def test_each_error_carries_a_valid_status_code_and_outcome(exc: VisionServeError) -> None:
    assert 400 <= exc.http_status < 600
    assert exc.grpc_code in grpc.StatusCode.__members__ and exc.grpc_code != "OK"
    assert exc.outcome in OUTCOMES and exc.outcome != "success"
    assert CANONICAL_HTTP.get(exc.grpc_code) == exc.http_status or (exc.http_status, exc.grpc_code) in REFINED
    assert outcome_label(exc) == exc.outcome
    assert code_of(exc) == grpc.StatusCode[exc.grpc_code]


def test_the_attributes_follow_the_tree() -> None:
    assert errors.PayloadTooLargeError.outcome == errors.BadInputError.outcome == "bad_input"
    assert errors.OutOfMemoryError.http_status == errors.RuntimeFailure.http_status == 500
    assert {c.http_status for c in CLASSES if c.grpc_code == "INTERNAL"} == {500}


def test_outcome_label_of_what_is_not_ours() -> None:
    assert outcome_label(asyncio.CancelledError()) == "cancelled"
    assert outcome_label(ValueError("x")) == outcome_label(KeyError("x")) == "error"


def test_an_overload_is_answered_503_or_429_and_nothing_else() -> None:
    assert (OverloadedError("full").http_status, OverloadedError("full").grpc_code) == (503, "UNAVAILABLE")
    assert OverloadedError.http_status == 503  # an instance's choice leaves the class alone
    with pytest.raises(ValueError, match="503 or 429, got 500"):
        OverloadedError("full", http_status=500)


@pytest.mark.parametrize("exc", [e for e in INSTANCES if not isinstance(e, ClientError)], ids=label)
def test_an_error_crosses_the_wire_with_its_status(exc: VisionServeError) -> None:
    wire = WireError.of(exc)
    # Only an instance's own choice travels, so the engine can still apply the model's queue_full_status.
    assert wire.status == (0 if exc.http_status == type(exc).http_status else exc.http_status)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(wire), type=WireError).exception()
    assert type(back) is type(exc) and str(back) == str(exc)
    assert (back.http_status, back.grpc_code, back.outcome) == (exc.http_status, exc.grpc_code, exc.outcome)


# ---- the two front ends, served -----------------------------------------------------------------------------------


@get("/raise/{index:int}", sync_to_thread=False)
def raising(index: FromPath[int]) -> None:
    raise INSTANCES[index]


APP = Litestar(
    route_handlers=[raising],
    exception_handlers={VisionServeError: handle_ours, HTTPException: handle_http, Exception: handle_unexpected},
    debug=False,
)


def http_answers() -> list[tuple[int, str | None, str]]:
    with TestClient(APP) as client:
        answers = []
        for i in range(len(INSTANCES)):
            response = client.get(f"/raise/{i}")
            answers.append((response.status_code, response.headers.get("retry-after"), response.json()["error"]))
        return answers


async def grpc_answers() -> list[tuple[str, str | None, str]]:
    async def method(request: bytes, context: Any) -> bytes:
        raise INSTANCES[int(request)]

    handler = grpc.method_handlers_generic_handler(
        "test.Errors", {"Raise": grpc.unary_unary_rpc_method_handler(_guarded("Raise", method))}
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    answers = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/test.Errors/Raise")
            for i in range(len(INSTANCES)):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call(str(i).encode())
                trailers = dict(info.value.trailing_metadata() or ())
                answers.append((info.value.code().name, trailers.get("retry-after"), info.value.details() or ""))
    finally:
        await server.stop(None)
    return answers


def test_http_and_grpc_answer_each_error_as_it_says() -> None:
    for exc, (status, http_retry, http_message), (code, grpc_retry, grpc_message) in zip(
        INSTANCES, http_answers(), asyncio.run(grpc_answers()), strict=True
    ):
        assert (status, code) == (exc.http_status, exc.grpc_code), label(exc)
        assert http_retry == grpc_retry == (None if exc.retry_after_s is None else str(exc.retry_after_s))
        assert http_message == grpc_message == str(exc)
