"""Numbers no option can take, on every surface that reads a model's options: the image API's query, v2
``parameters`` over HTTP and the WebSocket stream's query. Each is a 400 (or the stream's error answer and 1008)
naming the option, never a 500: a ``classes`` of 4,301 digits (Python's ``int`` and ``str`` refuse past 4300, a
ValueError that was a 500 on all three, and gRPC's INTERNAL), a ``max_detections`` of as many on the stream, and
``1e999`` (infinity), ``-1e999`` and NaN for each numeric option (``score_threshold``, ``iou_threshold``,
``max_detections``, a classifier's ``top_k``).

In one process (docs/testing.md), over the shipped examples (nothing trained): each case is one request.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from service.core.settings import ServerSettings
from service.inprocess import InProcessServer
from tests.conftest import encode_image, random_image

ROOT = Path(__file__).resolve().parents[2]
HUGE = "1" * 4301  # one digit past what int() reads
IMAGE = encode_image(random_image(40, 40))
# The option's text in a query, and as the JSON literal a v2 body holds (NaN and Infinity: Python's json writes them).
VALUES = {"1e999": "1e999", "-1e999": "-1e999", "nan": "NaN", "inf": "Infinity", HUGE: HUGE}
DETECT_OPTIONS = ("score_threshold", "iou_threshold", "max_detections")
CASES = [(name, text) for name in DETECT_OPTIONS for text in VALUES]
IDS = [f"{name}={text[:6]}" for name, text in CASES]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    repo = tmp_path_factory.mktemp("numbers-repo")
    for name in ("digits", "digits-detect"):
        shutil.copytree(ROOT / "examples" / "model_repository" / name, repo / name)
    with InProcessServer(ServerSettings(repository=str(repo), port=0, grpc_port=0), grpc=True) as running:
        yield running


def query_refusal(server: InProcessServer, route: str, query: str) -> str:
    with server.client() as client:
        answer = client.post(f"/v1/models/{route}?{query}", content=IMAGE, headers={"content-type": "image/png"})
    assert answer.status_code == 400, answer.text
    return str(answer.json()["error"])


def v2_refusal(server: InProcessServer, parameters: str) -> str:
    """The error of a v2 request to the detector whose ``parameters`` object is ``parameters`` (JSON text)."""
    inputs = '[{"name": "IMAGE", "shape": [1], "datatype": "BYTES", "data": ["x"]}]'
    body = f'{{"inputs": {inputs}, "parameters": {parameters}}}'
    with server.client() as client:
        answer = client.post("/v2/models/digits-detect/infer", content=body,
                             headers={"content-type": "application/json"})  # fmt: skip
    assert answer.status_code == 400, answer.text
    return str(answer.json()["error"])


def grpc_refusal(server: InProcessServer, parameters: dict[str, str]) -> str:
    """The message of a gRPC ModelInfer to the detector with these ``parameters``: INVALID_ARGUMENT, as a 400."""
    import numpy as np
    import tritonclient.grpc as tgrpc
    from tritonclient.utils import InferenceServerException

    tensor = tgrpc.InferInput("IMAGE", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([IMAGE], dtype=np.object_))
    client = tgrpc.InferenceServerClient(server.grpc_target)
    try:
        with pytest.raises(InferenceServerException) as caught:
            client.infer("digits-detect", [tensor], parameters=parameters, client_timeout=30)
    finally:
        client.close()
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT", caught.value
    return str(caught.value.message())


def stream_refusal(server: InProcessServer, model: str, query: str) -> str:
    """The error answer a stream opened with ``query`` gets, then its close: 1008 (policy), never 1011 or 4500."""
    with connect(f"{server.url.replace('http', 'ws', 1)}/v1/models/{model}/stream?{query}", open_timeout=30) as ws:
        first = json.loads(ws.recv(timeout=30))
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=30)
        assert ws.close_code == 1008, (ws.close_code, ws.close_reason)
    assert first["status"] == "error", first
    return str(first["error"])


@pytest.mark.parametrize(("name", "text"), CASES, ids=IDS)
def test_a_number_no_option_takes_is_400_naming_it_in_the_query(server: InProcessServer, name: str, text: str) -> None:
    assert name in query_refusal(server, "digits-detect/detect", f"{name}={text}")


@pytest.mark.parametrize(("name", "text"), CASES, ids=IDS)
def test_a_number_no_option_takes_is_400_naming_it_in_v2_parameters(
    server: InProcessServer, name: str, text: str
) -> None:
    assert f"parameters.{name}" in v2_refusal(server, f'{{"{name}": {VALUES[text]}}}')


@pytest.mark.parametrize(("name", "text"), CASES, ids=IDS)
def test_a_number_no_option_takes_refuses_the_stream_naming_it(server: InProcessServer, name: str, text: str) -> None:
    assert name in stream_refusal(server, "digits-detect", f"{name}={text}")


@pytest.mark.parametrize("text", list(VALUES), ids=[t[:6] for t in VALUES])
def test_a_top_k_no_classifier_takes_is_refused_naming_it(server: InProcessServer, text: str) -> None:
    assert "top_k" in query_refusal(server, "digits/classify", f"top_k={text}")
    assert "top_k" in stream_refusal(server, "digits", f"top_k={text}")


def test_a_class_of_4301_digits_is_400_naming_classes_on_every_surface(server: InProcessServer) -> None:
    said = [
        query_refusal(server, "digits-detect/detect", f"classes={HUGE}"),
        stream_refusal(server, "digits-detect", f"classes={HUGE}"),
        v2_refusal(server, f'{{"classes": "{HUGE}"}}'),  # gRPC's form too: one string, classes split by commas
        v2_refusal(server, f'{{"classes": ["{HUGE}"]}}'),
        v2_refusal(server, f'{{"classes": [{HUGE}]}}'),  # a JSON integer msgspec will not read: named all the same
    ]
    said.append(grpc_refusal(server, {"classes": HUGE}))  # a gRPC InferParameter holds one string
    for message in said:
        assert message.startswith(("classes", "parameters.classes")), said
        assert HUGE not in message and len(message) < 300, message  # the value is cut, not echoed whole
    assert "unknown class" in said[0] and "an index from 0 to 9" in said[0]
