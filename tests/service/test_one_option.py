"""A task's options are declared once (issue 52): one field added to a task's options struct, in this file alone, is
accepted, checked (a bad value a 400 / INVALID_ARGUMENT naming it, with what it takes) and described on every
reader: the image API's query and its OpenAPI schema, v2 ``parameters`` over HTTP and gRPC (and the model config
that lists them), the WebSocket stream's query, a gRPC stream's parameters, a source's JSON body and its PATCH,
the Python client's keyword arguments and the command line's flags.

The test-only option (``margin``) means nothing to the answer; what is held is that no protocol needed an edit.
"""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import httpx
import msgspec
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import websockets
from tritonclient.utils import InferenceServerException

from service.cli import build_parser
from service.client import Client, ClientError
from service.core.arguments import option_flags
from service.core.settings import ServerSettings
from service.core.tasks import Detect, DetectOptions
from service.inprocess import InProcessServer
from tests.http.test_detect import detector_repo, encoded, upright
from tests.sources.video import write_mp4

ADMIN = "one-option-token"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
FRAME = encoded(upright(80, 100, (20, 10, 60, 40)))
TAKES = "margin must be a number from 0 to 10"
DESCRIBED = "pixels added around each box"


class WiderOptions(DetectOptions, frozen=True, kw_only=True):
    margin: Annotated[float, msgspec.Meta(ge=0, le=10, description=DESCRIBED)] = 0.0


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[InProcessServer, Path]]:
    root = tmp_path_factory.mktemp("one-option")
    patch = pytest.MonkeyPatch()
    patch.setattr(Detect, "Options", WiderOptions)  # the one place
    clips = root / "clips"
    clips.mkdir()
    write_mp4(clips / "clip.mp4", frames=15)
    settings = ServerSettings(
        repository=str(detector_repo(root / "repo")), port=0, grpc_port=0, admin_token=ADMIN,
        source_root=str(clips), state_dir=str(root / "state"),
    )  # fmt: skip
    try:
        with InProcessServer(settings, grpc=True) as running:
            yield running, clips / "clip.mp4"
    finally:
        patch.undo()


def test_the_image_api_takes_it_checks_it_and_lists_it_in_its_schema(served: tuple[InProcessServer, Path]) -> None:
    server, _ = served
    with server.client() as client:
        headers = {"content-type": "image/png"}
        ok = client.post("/v1/models/bright/detect", params={"margin": "2.5"}, content=FRAME, headers=headers)
        bad = client.post("/v1/models/bright/detect", params={"margin": "11"}, content=FRAME, headers=headers)
        schema = client.get("/schema/openapi.json").json()
    assert ok.status_code == 200, ok.text
    assert bad.status_code == 400 and bad.json()["error"] == f"{TAKES}, got '11' (query parameter)"
    listed = {p["name"]: p for p in schema["paths"]["/v1/models/{model}/detect"]["post"]["parameters"]}
    assert DESCRIBED in listed["margin"]["description"]
    assert listed["margin"]["schema"]["maximum"] == 10


def test_v2_parameters_over_http_and_grpc_take_it_and_the_config_describes_it(
    served: tuple[InProcessServer, Path],
) -> None:
    server, _ = served
    data = np.array([FRAME], dtype=object)
    http = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    image = httpclient.InferInput("IMAGE", [1], "BYTES")
    image.set_data_from_numpy(data)
    assert http.infer("bright.image", [image], parameters={"margin": 3}).as_numpy("NUM_DETECTIONS") is not None
    with pytest.raises(InferenceServerException, match=f"parameters.{TAKES}, got 11"):
        http.infer("bright.image", [image], parameters={"margin": 11})
    assert DESCRIBED in http.get_model_config("bright")["parameters"]["margin"]["string_value"]
    grpc = grpcclient.InferenceServerClient(server.grpc_target)
    tensor = grpcclient.InferInput("IMAGE", [1], "BYTES")
    tensor.set_data_from_numpy(data)
    assert grpc.infer("bright.image", [tensor], parameters={"margin": 3}).as_numpy("NUM_DETECTIONS") is not None
    with pytest.raises(InferenceServerException, match=f"parameters.{TAKES}, got 11") as refused:
        grpc.infer("bright.image", [tensor], parameters={"margin": 11})
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
    config = grpc.get_model_config("bright", as_json=True)["config"]
    assert DESCRIBED in config["parameters"]["margin"]["string_value"]


def test_the_websocket_stream_takes_it_and_refuses_a_bad_one_naming_it(served: tuple[InProcessServer, Path]) -> None:
    server, _ = served
    base = server.url.replace("http://", "ws://") + "/v1/models/bright/stream?max_age_ms=10000&margin="

    async def first(margin: str, send: bool = True) -> dict[str, Any]:
        async with websockets.connect(base + margin) as ws:
            header = json.dumps({"id": 1, "ts": 0}).encode()
            if send:
                await ws.send(struct.pack(">I", len(header)) + header + FRAME)
            answer: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), 30))
            return answer

    assert asyncio.run(first("4"))["status"] == "result"
    refused = asyncio.run(first("eleven", send=False))  # the stream is refused before any frame
    assert refused["status"] == "error" and f"{TAKES}, got 'eleven'" in refused["error"]


def test_a_sources_body_and_its_patch_take_it_and_refuse_a_bad_one(served: tuple[InProcessServer, Path]) -> None:
    server, clip = served
    body = {"url": clip.as_uri(), "model": "bright", "id": "wide", "pace": "answered", "margin": 1.5}
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as client:
        bad = client.post("/v1/sources", json={**body, "id": "bad", "margin": 11})
        created = client.post("/v1/sources", json=body)
        patched = client.patch("/v1/sources/wide", json={"margin": 2})
        wrong = client.patch("/v1/sources/wide", json={"margin": -1})
        client.delete("/v1/sources/wide")
    assert bad.status_code == 400 and f"{TAKES}, got 11" in bad.json()["error"]
    assert created.status_code == 201, created.text
    assert created.json()["options"]["margin"] == 1.5
    assert patched.status_code == 200 and patched.json()["options"]["margin"] == 2
    assert wrong.status_code == 400 and f"{TAKES}, got -1" in wrong.json()["error"]


def test_the_python_client_takes_it_as_a_keyword(served: tuple[InProcessServer, Path]) -> None:
    server, _ = served
    with Client(server.url, model="bright") as client:
        assert client.detect([FRAME], margin=2)[0].ok
        with pytest.raises(ClientError, match=TAKES):
            client.detect([FRAME, FRAME], margin=11)  # two images: the request, not one image, is refused
        with pytest.raises(TypeError, match="margn"):
            client.detect([FRAME], margn=2)


COMMANDS = {  # each command line that takes a task's options, with the words it needs beside them
    "detect": ["--model", "bright", "x.png"],
    "watch": ["--url", "http://127.0.0.1:9", "--source", "cam"],
    "loadtest": ["--model", "bright"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_the_command_line_has_its_flag_with_its_range_and_help(command: str) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Detect, "Options", WiderOptions)
        parser = build_parser(command)
        args = parser.parse_args([command, *COMMANDS[command], "--margin", "2.5"])
        assert option_flags(args, WiderOptions) == {"margin": 2.5}
        with pytest.raises(SystemExit) as refused:
            parser.parse_args([command, *COMMANDS[command], "--margin", "11"])
        assert refused.value.code == 2
        helped = parser._subparsers._group_actions[0].choices[command].format_help()  # type: ignore[union-attr]
    assert "--margin" in helped and DESCRIBED in helped
