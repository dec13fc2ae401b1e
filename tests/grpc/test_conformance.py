"""The same calls through tritonclient.http, tritonclient.http.aio and tritonclient.grpc against one real server
process: their answers must agree with each other (and the errors carry the same messages)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
import tritonclient.http.aio as thttp_aio
from tritonclient.utils import InferenceServerException

from tests.grpc.conftest import GrpcServer
from tests.http.test_image_api import digit_png

PIXELS = np.random.default_rng(2).integers(0, 256, (2, 3, 32, 32), dtype=np.uint8)
FILES = [digit_png(i)[0] for i in range(3)]
CLIENTS = ("http", "http.aio", "grpc")


def _inputs(module: Any, name: str) -> list[Any]:
    if name == "INPUT":
        tensor = module.InferInput("INPUT", list(PIXELS.shape), "UINT8")
        tensor.set_data_from_numpy(PIXELS)
    else:
        tensor = module.InferInput("IMAGE", [len(FILES)], "BYTES")
        tensor.set_data_from_numpy(np.array(FILES, dtype=np.object_))
    return [tensor]


def _outputs(module: Any, k: int | None) -> list[Any]:
    return [module.InferRequestedOutput("LOGITS", class_count=k or 0)]


def _shape(tensors: list[dict[str, Any]]) -> list[tuple[str, str, list[int]]]:
    return [(t["name"], t["datatype"], [int(d) for d in t["shape"]]) for t in tensors]


class Calls:
    """One client's view of the server, as plain Python values, so the three can be compared."""

    def __init__(self, kind: str, both: GrpcServer) -> None:
        self.kind = kind
        self.both = both

    def run(self, name: str, *args: Any) -> Any:
        """The answer to ``name(*args)``, or ("error", message) when the client raises."""
        try:
            if self.kind == "http.aio":
                return asyncio.run(self._aio(name, *args))
            module: Any = thttp if self.kind == "http" else tgrpc
            target = self.both.http.url.removeprefix("http://") if self.kind == "http" else self.both.target
            client = module.InferenceServerClient(target)
            try:
                return _normal(name, self._call(client, module, name, *args))
            finally:
                client.close()
        except InferenceServerException as exc:
            return ("error", exc.message())

    def _call(self, client: Any, module: Any, name: str, *args: Any) -> Any:
        grpc_json = {"as_json": True} if module is tgrpc else {}
        if name == "infer":
            model, input_name, k = args
            return client.infer(model, _inputs(module, input_name), outputs=_outputs(module, k)).as_numpy("LOGITS")
        if name in ("is_server_live", "is_server_ready"):
            return getattr(client, name)()
        if name == "is_model_ready":
            return client.is_model_ready(*args)
        return getattr(client, name)(*args, **grpc_json)

    async def _aio(self, name: str, *args: Any) -> Any:
        client = thttp_aio.InferenceServerClient(self.both.http.url.removeprefix("http://"))
        try:
            if name == "infer":
                model, input_name, k = args
                result = await client.infer(model, _inputs(thttp_aio, input_name), outputs=_outputs(thttp_aio, k))
                return _normal(name, result.as_numpy("LOGITS"))
            if name in ("is_server_live", "is_server_ready"):
                return await getattr(client, name)()
            return _normal(name, await getattr(client, name)(*args))
        finally:
            await client.close()


def _normal(name: str, answer: Any) -> Any:
    """The parts every protocol must agree on (gRPC's JSON writes int64 as strings; HTTP's has extras)."""
    if name == "get_server_metadata":
        return {"name": answer["name"], "version": answer["version"], "extensions": sorted(answer["extensions"])}
    if name == "get_model_metadata":
        return {"name": answer["name"], "versions": answer["versions"], "platform": answer["platform"],
                "inputs": _shape(answer["inputs"]), "outputs": _shape(answer["outputs"])}  # fmt: skip
    if name == "get_model_config":
        config = answer.get("config", answer)
        return {
            "name": config["name"],
            "max_batch_size": int(config["max_batch_size"]),
            "input": [(i["name"], i["data_type"], [int(d) for d in i["dims"]]) for i in config["input"]],
            "output": [(o["name"], o["data_type"], [int(d) for d in o["dims"]]) for o in config["output"]],
            "delay_us": int(config["dynamic_batching"]["max_queue_delay_microseconds"]),
        }
    if name == "get_inference_statistics":
        return sorted((s["name"], s["version"]) for s in answer["model_stats"])
    if name == "infer" and answer.dtype == np.object_:
        return [[s.decode() if isinstance(s, bytes) else s for s in row] for row in answer.tolist()]
    return answer


CASES: list[tuple[str, tuple[Any, ...]]] = [
    ("is_server_live", ()),
    ("is_server_ready", ()),
    ("is_model_ready", ("digits",)),
    ("is_model_ready", ("digits.image", "1")),
    ("is_model_ready", ("nope",)),
    ("get_server_metadata", ()),
    ("get_model_metadata", ("digits",)),
    ("get_model_metadata", ("digits.image", "1")),
    ("get_model_metadata", ("nope",)),
    ("get_model_config", ("digits",)),
    ("get_model_config", ("digits.image",)),
    ("get_model_config", ("digits", "7")),
    ("get_inference_statistics", ("digits",)),
    ("infer", ("digits", "IMAGE", 3)),
    ("infer", ("digits.image", "IMAGE", 2)),
    ("infer", ("nope", "INPUT", None)),
]


@pytest.mark.parametrize(("name", "args"), CASES, ids=[f"{n}{list(a)}" for n, a in CASES])
def test_the_three_clients_agree(both: GrpcServer, name: str, args: tuple[Any, ...]) -> None:
    answers = {kind: Calls(kind, both).run(name, *args) for kind in CLIENTS}
    first = answers["http"]
    for kind in CLIENTS[1:]:
        assert answers[kind] == first, f"{kind} differs from http: {answers}"


def test_logits_agree_within_float_rounding(both: GrpcServer) -> None:
    answers = {kind: Calls(kind, both).run("infer", "digits", "INPUT", None) for kind in CLIENTS}
    for kind in CLIENTS:
        assert isinstance(answers[kind], np.ndarray) and answers[kind].shape == (2, 10), answers[kind]
        # Every protocol carries float32 bits unchanged (binary, raw contents): equal, not merely close.
        np.testing.assert_array_equal(answers[kind], answers["http"])


def test_errors_carry_the_same_message(both: GrpcServer) -> None:
    big = np.zeros((33, 3, 32, 32), np.uint8)
    answers = {}
    for kind in CLIENTS:
        module: Any = {"http": thttp, "http.aio": thttp_aio, "grpc": tgrpc}[kind]
        tensor = module.InferInput("INPUT", list(big.shape), "UINT8")
        tensor.set_data_from_numpy(big)
        answers[kind] = _infer_error(kind, both, "digits", tensor)
    assert len(set(answers.values())) == 1, answers
    status, message = answers["grpc"]
    assert status == "error" and "max_batch_size of 32" in message, answers


def _infer_error(kind: str, both: GrpcServer, model: str, tensor: Any) -> tuple[str, str]:
    try:
        if kind == "http.aio":

            async def go() -> None:
                client = thttp_aio.InferenceServerClient(both.http.url.removeprefix("http://"))
                try:
                    await client.infer(model, [tensor])
                finally:
                    await client.close()

            asyncio.run(go())
        elif kind == "http":
            thttp.InferenceServerClient(both.http.url.removeprefix("http://")).infer(model, [tensor])
        else:
            tgrpc.InferenceServerClient(both.target).infer(model, [tensor])
    except InferenceServerException as exc:
        return ("error", str(exc.message()))
    return ("ok", "")
