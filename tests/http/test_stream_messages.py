"""A WebSocket stream's messages that are no frame: each gets an error answer of its own and the stream goes on, a
text message as a binary one (docs/streams.md). A text ``[]`` (JSON, but no header object) was an AttributeError
that closed the whole session (1001, "draining"), and JSON nested past Python's recursion limit a RecursionError.

In one process (docs/testing.md), over the shipped digits classifier (nothing trained).
"""

from __future__ import annotations

import base64
import json
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
from websockets.sync.client import connect

from service.core.settings import ServerSettings
from service.inprocess import InProcessServer
from tests.conftest import encode_image, random_image

ROOT = Path(__file__).resolve().parents[2]
IMAGE = encode_image(random_image(28, 28))
NOT_FRAMES = ["[]", "5", '"text"', "null", "{", "", "[" * 100_000, '{"id": 1, "image_b64": 7}', '{"id": 2}']


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    repo = tmp_path_factory.mktemp("stream-messages-repo")
    shutil.copytree(ROOT / "examples" / "model_repository" / "digits", repo / "digits")
    with InProcessServer(ServerSettings(repository=str(repo), port=0, grpc_port=0)) as running:
        yield running


def test_a_text_message_that_is_no_frame_is_answered_alone_and_the_stream_goes_on(server: InProcessServer) -> None:
    good = json.dumps({"id": "good", "ts": 1.5, "image_b64": base64.b64encode(IMAGE).decode()})
    header = json.dumps({"id": "binary"}).encode()
    with connect(f"{server.url.replace('http', 'ws', 1)}/v1/models/digits/stream", open_timeout=30) as ws:
        for text in NOT_FRAMES:
            ws.send(text)
            answer = json.loads(ws.recv(timeout=30))  # one answer each, in order: the session is still open
            assert answer["status"] == "error" and answer["error"], (text[:20], answer)
            if text == "[]":
                assert answer["error"].startswith("not a frame: the header is not a JSON object"), answer
        ws.send(b"[]")  # a binary message's header that is no object: the same, as it always was
        assert json.loads(ws.recv(timeout=30))["status"] == "error"
        ws.send(good)
        answer = json.loads(ws.recv(timeout=30))
        assert (answer["id"], answer["ts"], answer["status"]) == ("good", 1.5, "result"), answer
        assert answer["predictions"]
        ws.send(struct.pack(">I", len(header)) + header + IMAGE)
        assert json.loads(ws.recv(timeout=30))["status"] == "result"
