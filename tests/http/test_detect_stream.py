"""Streams of a detector (docs/streams.md) against a real server process: each frame's detections over the WebSocket
(the detect route's options as the query) and DETECTIONS / NUM_DETECTIONS over gRPC's ``ModelStreamInfer`` through
tritonclient's stream API, boxes in the frame's own pixels.

The detector is tests/http/test_detect.py's: it finds a frame's bright rectangle exactly and answers it as class
``one`` (0.9), with a duplicate (``one``, 0.8), the same box as ``zero`` (0.7), a fixed box at the input's centre
(``two``, 0.5) and a decoy under the default threshold (``zero``, 0.1).
"""

from __future__ import annotations

import asyncio
import json
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import websockets
from tritonclient.utils import InferenceServerException

from service.launcher import RunningServer, free_port
from tests.grpc.conftest import wait_for_grpc
from tests.grpc.test_grpc import images_input
from tests.http.conftest import start_server, stop_server
from tests.http.test_detect import detector_repo, encoded, tolerance, upright

BOX = (20, 10, 60, 40)  # the bright rectangle of an 80 x 100 frame
FRAME = encoded(upright(80, 100, BOX))
# Stored turned, shown upright by EXIF orientation 6: a viewer sees 90 wide, 120 high, the rectangle at TURNED_BOX.
TURNED_BOX = (5, 70, 60, 115)
TURNED = encoded(upright(120, 90, TURNED_BOX), "PNG", 6)
RESULT_KEYS = ["id", "ts", "status", "age_ms", "version", "detections", "width", "height", "timings_ms"]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("detect-stream")
    server = start_server(detector_repo(root / "repo"), root / "server.log", grpc_port=free_port(),
                          real_models=("bright",))  # fmt: skip
    wait_for_grpc(server.grpc_target)
    try:
        yield server
    finally:
        stop_server(server)


def ws_url(server: RunningServer, query: str = "") -> str:
    url = server.url.replace("http://", "ws://") + "/v1/models/bright/stream?max_age_ms=10000"
    return url + (f"&{query}" if query else "")


def frame(frame_id: Any, image: bytes = FRAME) -> bytes:
    header = json.dumps({"id": frame_id, "ts": 17.5}).encode()
    return struct.pack(">I", len(header)) + header + image


async def one_answer(ws: Any, frame_id: Any, image: bytes = FRAME) -> dict[str, Any]:
    """One frame sent and its answer read: frames one at a time, so that none supersedes another."""
    await ws.send(frame(frame_id, image))
    answer: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), 30))
    return answer


def off_by(found: list[float], box: tuple[float, ...]) -> float:
    return float(np.abs(np.array(found) - np.array(box)).max())


def test_a_websocket_frame_is_answered_with_its_boxes_in_its_own_pixels(served: RunningServer) -> None:
    async def run() -> list[dict[str, Any]]:
        # top_k is a classifier's: a detector's stream passes it over, as /detect does.
        async with websockets.connect(ws_url(served, "top_k=3")) as ws:
            return [await one_answer(ws, 1), await one_answer(ws, "turned", TURNED)]

    plain, turned = asyncio.run(run())
    print(f"\nframe answers: {plain}\n{turned}")
    assert list(plain) == RESULT_KEYS  # exactly what the demo page's live mode draws
    assert (plain["id"], plain["ts"], plain["status"]) == (1, 17.5, "result")
    assert plain["version"] == 1 and set(plain["timings_ms"]) == {"wait", "decode", "queue", "compute"}
    assert (plain["width"], plain["height"]) == (100, 80)
    found = plain["detections"]
    assert [(d["label"], d["index"]) for d in found] == [("one", 1), ("zero", 0), ("two", 2)]
    assert found[0]["score"] == pytest.approx(0.9) and set(found[0]) == {"box", "label", "index", "score"}
    assert off_by(found[0]["box"], BOX) <= tolerance(80, 100)
    # EXIF orientation applied: the size and the box are those of the frame as a viewer shows it.
    assert (turned["width"], turned["height"]) == (90, 120)
    assert off_by(turned["detections"][0]["box"], TURNED_BOX) <= tolerance(120, 90)


def test_the_detect_routes_options_shape_each_frames_answer(served: RunningServer) -> None:
    queries = [
        "score_threshold=0.6", "class_agnostic=true", "classes=two&classes=0", "iou_threshold=0.99&max_detections=3",
        "classes=one&box_format=cxcywh&normalized=true", "box_format=xywh", "score_threshold=0.95",
    ]  # fmt: skip

    async def run() -> list[dict[str, Any]]:
        got = []
        for query in queries:
            async with websockets.connect(ws_url(served, query)) as ws:
                got.append(await one_answer(ws, query))
        return got

    answers = dict(zip(queries, asyncio.run(run()), strict=True))
    labels = {query: [d["label"] for d in a["detections"]] for query, a in answers.items()}
    print(f"\nlabels by query: {labels}")
    assert labels["score_threshold=0.6"] == ["one", "zero"]
    assert labels["class_agnostic=true"] == ["one", "two"]
    assert labels["classes=two&classes=0"] == ["zero", "two"]
    assert labels["iou_threshold=0.99&max_detections=3"] == ["one", "one", "zero"]
    x1, y1, x2, y2 = answers["score_threshold=0.6"]["detections"][0]["box"]
    centre = answers["classes=one&box_format=cxcywh&normalized=true"]["detections"][0]["box"]
    assert centre == pytest.approx([(x1 + x2) / 200, (y1 + y2) / 160, (x2 - x1) / 100, (y2 - y1) / 80])
    assert answers["box_format=xywh"]["detections"][0]["box"] == pytest.approx([x1, y1, x2 - x1, y2 - y1])
    none = answers["score_threshold=0.95"]  # nothing scores as much: a result with no boxes, and the frame's size
    assert none["status"] == "result" and none["detections"] == [] and (none["width"], none["height"]) == (100, 80)


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("score_threshold=2", "score_threshold must be a number from 0 to 1, got '2'"),
        ("score_threshold=high", "score_threshold must be a number from 0 to 1, got 'high'"),
        ("max_detections=0", "max_detections must be an integer from 1 to 10000, got '0'"),
        ("classes=seven", "classes: unknown class 'seven'"),
        ("box_format=xxyy", "box_format must be one of xyxy, xywh, cxcywh"),
        ("class_agnostic=maybe", "class_agnostic must be true or false, got 'maybe'"),
    ],
)
def test_a_bad_option_refuses_the_stream_with_its_message(served: RunningServer, query: str, message: str) -> None:
    async def run() -> tuple[dict[str, Any], int | None]:
        async with websockets.connect(ws_url(served, query)) as ws:
            first = json.loads(await asyncio.wait_for(ws.recv(), 30))
            with pytest.raises(websockets.ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 30)
            return first, ws.close_code

    first, code = asyncio.run(run())
    assert first["status"] == "error" and message in first["error"], first
    assert code == 1008


class Callbacks:
    """tritonclient's stream callback: every (result, error) it is handed, in order."""

    def __init__(self) -> None:
        self.got: list[tuple[Any, InferenceServerException | None]] = []
        self._changed = threading.Condition()

    def __call__(self, result: Any, error: InferenceServerException | None) -> None:
        with self._changed:
            self.got.append((result, error))
            self._changed.notify_all()

    def wait(self, n: int, timeout_s: float = 30) -> tuple[Any, InferenceServerException | None]:
        """The ``n``-th callback (from 1), once it came."""
        with self._changed:
            assert self._changed.wait_for(lambda: len(self.got) >= n, timeout_s), f"{len(self.got)} of {n} callbacks"
            return self.got[n - 1]


def test_a_grpc_stream_answers_detections_per_frame_with_each_frames_thresholds(served: RunningServer) -> None:
    calls = Callbacks()
    client = tgrpc.InferenceServerClient(served.grpc_target)
    client.start_stream(calls)

    def send(frame_id: str, data: bytes, outputs: tuple[str, ...] = (), **params: Any) -> None:
        wanted = [tgrpc.InferRequestedOutput(name) for name in outputs] or None
        params.setdefault("max_age_ms", 10_000)  # the first frame's sets the stream's
        params.setdefault("client_ts", time.time())
        client.async_stream_infer("bright", [images_input([data])], request_id=frame_id, parameters=params,
                                  outputs=wanted)  # fmt: skip

    try:
        send("plain", FRAME)
        plain, error = calls.wait(1)
        send("strict", TURNED, score_threshold=0.6, max_detections=4, classes="one,two")
        strict, error2 = calls.wait(2)
        send("bad", FRAME, score_threshold=2)
        _, bad = calls.wait(3)
        send("count", FRAME, ("NUM_DETECTIONS",), class_agnostic=True)
        count, error4 = calls.wait(4)
    finally:
        client.stop_stream()
        client.close()
    assert error is None and error2 is None and error4 is None, (error, error2, error4)
    assert plain.get_response().id == "plain" and plain.get_response().parameters["status"].string_param == "result"
    boxes, counts = plain.as_numpy("DETECTIONS"), plain.as_numpy("NUM_DETECTIONS")
    print(f"\ngRPC plain frame: {counts.tolist()} {boxes[0, : counts[0]].round(2).tolist()}")
    assert boxes.shape == (1, 100, 6) and counts.tolist() == [3]  # the spec's max_detections: the server's default
    assert boxes[0, :3, 5].tolist() == [1, 0, 2] and boxes[0, 0, 4] == pytest.approx(0.9)
    assert off_by(boxes[0, 0, :4].tolist(), BOX) <= tolerance(80, 100) and not boxes[0, 3:].any()
    # Each frame's own thresholds: 0.6 and the class filter leave one box, in the turned frame's shown pixels.
    boxes = strict.as_numpy("DETECTIONS")
    assert boxes.shape == (1, 4, 6) and strict.as_numpy("NUM_DETECTIONS").tolist() == [1]
    assert boxes[0, 0, 5] == 1 and off_by(boxes[0, 0, :4].tolist(), TURNED_BOX) <= tolerance(120, 90)
    assert bad is not None and "frame bad: parameters.score_threshold must be a number from 0 to 1" in bad.message()
    assert count.as_numpy("DETECTIONS") is None and count.as_numpy("NUM_DETECTIONS").tolist() == [2]


def test_a_websocket_stream_that_asks_to_track_gives_each_box_its_track_across_frames(served: RunningServer) -> None:
    async def run() -> list[dict[str, Any]]:
        async with websockets.connect(ws_url(served, "track=1")) as ws:
            return [await one_answer(ws, i) for i in range(3)]

    answers = asyncio.run(run())
    ids = [[d["track_id"] for d in a["detections"]] for a in answers]
    tracked = [i for i in ids[0] if i is not None]  # the box answered again as "zero" is the same object: no track
    assert len(tracked) == 2 and len(set(tracked)) == 2 and ids[0][1] is None, ids
    assert ids[1] == ids[2] == ids[0], ids  # the same boxes, the same tracks


def test_a_grpc_stream_that_asks_to_track_answers_track_ids_beside_its_detections(served: RunningServer) -> None:
    calls = Callbacks()
    client = tgrpc.InferenceServerClient(served.grpc_target)
    client.start_stream(calls)
    try:
        for i in range(3):  # the first frame's parameters open the stream: track with them
            client.async_stream_infer("bright", [images_input([FRAME])], request_id=str(i),
                                      parameters={"max_age_ms": 10_000, "track": True})  # fmt: skip
            calls.wait(i + 1)
    finally:
        client.stop_stream()
        client.close()
    ids = []
    for result, error in calls.got:
        assert error is None, error.message()
        n = int(result.as_numpy("NUM_DETECTIONS")[0])
        track = result.as_numpy("TRACK_IDS")
        assert track.shape == result.as_numpy("DETECTIONS").shape[:2] and (track[0, n:] == -1).all(), track
        ids.append(track[0, :n].tolist())
    assert ids[0][0] > 0 and ids[0][1] == -1 and ids[1] == ids[2] == ids[0], ids  # as the WebSocket's
