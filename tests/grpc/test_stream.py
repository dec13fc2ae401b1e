"""gRPC streams (``ModelStreamInfer``, docs/streams.md) against a real server process, through tritonclient's
``start_stream`` / ``async_stream_infer`` unchanged.

The model is the shipped digits model slowed by its config (``[faults] delay_ms``): a frame computes for a known
time whatever the machine, so the frames of a burst sent while one computes wait and supersede each other.
"""

from __future__ import annotations

import re
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
from tritonclient.utils import InferenceServerException

from service.core.protocol import method_path, pb
from service.launcher import RunningServer, free_port
from tests.grpc.conftest import wait_for_grpc
from tests.grpc.test_grpc import images_input, pixels_input
from tests.http.conftest import busy_model, metric_value, start_server, stop_server, wait_for_metric

EXAMPLES = Path(__file__).parents[2] / "examples"
DIGIT = (EXAMPLES / "digit-3.png").read_bytes()
DELAY_MS = 300  # each batch's compute: frames sent during it wait, and supersede each other
FRAME = re.compile(r"frame (\S*): ")


def _server(tmp_path: Path, delay_ms: float) -> RunningServer:
    repo = tmp_path / "repo"
    shutil.copytree(EXAMPLES / "model_repository" / "digits", repo / "digits")
    (repo / "digits" / "config.toml").write_text(f"max_queue_delay_ms = 0\n[faults]\ndelay_ms = {delay_ms}\n")
    server = start_server(repo, tmp_path / "server.log", grpc_port=free_port())
    wait_for_grpc(server.grpc_target)
    return server


@pytest.fixture(scope="module")
def paced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    server = _server(tmp_path_factory.mktemp("stream"), DELAY_MS)
    try:
        yield server
    finally:
        stop_server(server)


class Callbacks:
    """tritonclient's stream callback: every (result, error) it is handed, in order."""

    def __init__(self) -> None:
        self.got: list[tuple[Any, InferenceServerException | None]] = []
        self._changed = threading.Condition()

    def __call__(self, result: Any, error: InferenceServerException | None) -> None:
        with self._changed:
            self.got.append((result, error))
            self._changed.notify_all()

    def wait(self, n: int, timeout_s: float = 30) -> list[tuple[Any, InferenceServerException | None]]:
        with self._changed:
            assert self._changed.wait_for(lambda: len(self.got) >= n, timeout_s), f"{len(self.got)} of {n} callbacks"
            return list(self.got)

    def wait_for(self, wanted: tuple[str, str], timeout_s: float = 30) -> None:
        """Until a callback's :func:`fate` is ``wanted``."""
        self.wait_until(lambda fates: wanted in fates, timeout_s, what=f"no {wanted}")

    def wait_until(self, done: Callable[[list[tuple[str, str]]], bool], timeout_s: float = 30, what: str = "") -> None:
        """Until ``done`` holds of the callbacks' :func:`fate` s so far."""
        with self._changed:
            got = self._changed.wait_for(lambda: done([fate(*call) for call in self.got]), timeout_s)
            assert got, f"{what or 'not done'} in {[fate(*call) for call in self.got]}"


def fate(result: Any, error: InferenceServerException | None) -> tuple[str, str]:
    """(frame id, status) of one callback: a frame's error names the frame in its message."""
    if error is not None:
        match = FRAME.match(str(error.message()))
        assert match, f"not a frame's error: {error}"
        return match.group(1), "error"
    response = result.get_response()
    return response.id, response.parameters["status"].string_param


def send(
    client: tgrpc.InferenceServerClient, frame_id: Any, data: bytes = DIGIT, classes: int = 0, **params: Any
) -> None:
    """One frame; ``classes``: the classification extension's k on LOGITS (0: the logits themselves)."""
    params.setdefault("client_ts", time.time() * 1000)
    params.setdefault("max_age_ms", 5000)  # a stream's first frame sets it: past an earlier test's last batches
    outputs = [tgrpc.InferRequestedOutput("LOGITS", class_count=classes)]
    client.async_stream_infer(
        "digits", [images_input([data])], request_id=str(frame_id), parameters=params, outputs=outputs
    )


def a_new_stream_is_served(server: RunningServer) -> None:
    """A fresh stream's frame gets a result (what went before left the server serving)."""
    calls = Callbacks()
    client = tgrpc.InferenceServerClient(server.grpc_target)
    client.start_stream(calls)
    try:
        send(client, "next")
        assert fate(*calls.wait(1)[0]) == ("next", "result")
    finally:
        client.stop_stream()
        client.close()


def until_computing(server: RunningServer, timeout_s: float = 10) -> None:
    """Until the model computes a batch (its in-flight gauge on /metrics): the frame sent before is in it."""
    deadline = time.monotonic() + timeout_s
    while metric_value(server.url, "visionserve_inflight_batches", model="digits") < 1:
        assert time.monotonic() < deadline, "no batch computed"


def test_a_burst_supersedes_and_every_frame_gets_exactly_one_callback(paced: RunningServer) -> None:
    calls = Callbacks()
    client = tgrpc.InferenceServerClient(paced.grpc_target)
    client.start_stream(calls)
    try:
        send(client, 0, max_age_ms=5000, client_ts=17.5)
        until_computing(paced)  # frame 0 computes for DELAY_MS: 1..9 arrive meanwhile
        for i in range(1, 10):
            send(client, i, client_ts=float(i))
        got = calls.wait(10)
    finally:
        client.stop_stream()
        client.close()
    fates = dict(fate(*call) for call in got)
    print(f"\nburst: {[fate(*call) for call in got]}")
    assert len(got) == 10 and sorted(fates, key=int) == [str(i) for i in range(10)]  # one callback per frame
    assert [i for i in range(10) if fates[str(i)] == "result"] == [0, 9]
    assert [i for i in range(10) if fates[str(i)] == "superseded"] == list(range(1, 9))
    by_id = {result.get_response().id: result for result, _ in got}
    for i in (0, 9):
        logits = by_id[str(i)].as_numpy("LOGITS")
        assert logits.dtype == np.float32 and logits.shape == (1, 10) and int(logits.argmax()) == 3
    first = by_id["0"].get_response().parameters
    assert first["client_ts"].double_param == 17.5 and first["age_ms"].double_param >= DELAY_MS
    assert first["compute_ms"].double_param >= DELAY_MS and {"wait_ms", "decode_ms", "queue_ms"} <= set(first)
    for i in range(1, 9):
        response = by_id[str(i)].get_response()
        assert not response.outputs and response.parameters["client_ts"].double_param == float(i)
        assert response.parameters["by"].string_param == str(i + 1)


def test_frames_older_than_max_age_expire(paced: RunningServer) -> None:
    calls = Callbacks()
    client = tgrpc.InferenceServerClient(paced.grpc_target)

    def hold() -> int:
        with httpx.Client(base_url=paced.url, timeout=30) as http:
            return http.post(
                "/v1/models/digits/classify", content=DIGIT, headers={"content-type": "image/png"}
            ).status_code

    # The model's one instance is held by another request, seen computing for DELAY_MS, before the stream opens: every
    # frame, the first included, waits past its 5 ms on any machine. (Held by frame 0 itself, the test raced: on a
    # slow start frame 0 expired before any batch computed, and nothing held the rest.)
    with busy_model(paced.url, "digits", hold) as held:
        client.start_stream(calls)
        try:
            send(client, 0, max_age_ms=5)
            for i in range(1, 10):
                send(client, i, max_age_ms=60_000)  # the stream's bound is the first frame's
            got = calls.wait(10)
        finally:
            client.stop_stream()
            client.close()
        assert held.result() == 200
    fates = dict(fate(*call) for call in got)
    print(f"\nmax_age_ms 5: {[fate(*call) for call in got]}")
    assert len(got) == 10 and sorted(fates, key=int) == [str(i) for i in range(10)]
    assert set(fates.values()) <= {"result", "superseded", "expired"}
    assert fates["9"] == "expired"
    last = next(result for result, _ in got if result.get_response().id == "9").get_response()
    assert last.parameters["stage"].string_param in ("wait", "decode", "queue") and not last.outputs
    assert last.parameters["age_ms"].double_param > 5


def test_a_corrupt_frame_fails_alone(paced: RunningServer) -> None:
    calls = Callbacks()
    client = tgrpc.InferenceServerClient(paced.grpc_target)
    client.start_stream(calls)
    pixels = np.zeros((1, 3, 32, 32), dtype=np.uint8)
    try:
        send(client, "cut", DIGIT[:-40], max_age_ms=5000)  # the stream's bound: past an earlier test's last batch
        calls.wait(1)
        send(client, "good", classes=2)
        calls.wait(2)
        send(client, "empty", b"")
        calls.wait(3)
        client.async_stream_infer("digits", [pixels_input(pixels)], request_id="pixels")
        calls.wait(4)
        client.async_stream_infer("digits", [images_input([DIGIT])], model_version="1", request_id="other")
        calls.wait(5)
        send(client, "again")
        got = calls.wait(6)
    finally:
        client.stop_stream()
        client.close()
    print(f"\ncorrupt frames: {[(fate(*c), str(c[1])[:60]) for c in got]}")
    assert [fate(*call) for call in got] == [
        ("cut", "error"), ("good", "result"), ("empty", "error"), ("pixels", "error"), ("other", "error"),
        ("again", "result"),
    ]  # fmt: skip
    classes = [s.decode().split(":") for s in got[1][0].as_numpy("LOGITS").ravel()]
    assert len(classes) == 2 and classes[0][1:] == ["3", "3"], classes  # "score:index:label", best first
    errors = [str(error) for _, error in got if error is not None]
    assert "corrupt" in errors[0] and "no image" in errors[1] and "IMAGE" in errors[2]
    assert "a stream of its own" in errors[3]


def test_the_streams_top_k_answers_each_frame_that_names_no_output_with_its_k_best(paced: RunningServer) -> None:
    calls = Callbacks()
    client = tgrpc.InferenceServerClient(paced.grpc_target)
    client.start_stream(calls)
    try:
        params = {"top_k": 3, "max_age_ms": 5000}  # the stream's, from its first frame
        client.async_stream_infer("digits", [images_input([DIGIT])], request_id="first", parameters=params)
        calls.wait_for(("first", "result"))
        client.async_stream_infer("digits", [images_input([DIGIT])], request_id="second")
        calls.wait_for(("second", "result"))
        send(client, "named")  # a frame that names LOGITS gets the logits themselves
        calls.wait_for(("named", "result"))
    finally:
        client.stop_stream()
        client.close()
    answers = {fate(*call)[0]: call[0] for call in calls.got}
    for frame in ("first", "second"):
        best = [s.decode().split(":") for s in answers[frame].as_numpy("LOGITS").ravel()]
        assert len(best) == 3 and best[0][1:] == ["3", "3"], (frame, best)  # "score:index:label", best first
    assert answers["named"].as_numpy("LOGITS").shape == (1, 10)


@pytest.mark.parametrize(
    ("model", "params", "status", "words"),
    [
        ("nope", {}, "StatusCode.NOT_FOUND", "unknown model 'nope'"),
        ("digits", {"max_age_ms": 0}, "StatusCode.INVALID_ARGUMENT", "max_age_ms must be"),
        ("digits", {"top_k": 0}, "StatusCode.INVALID_ARGUMENT", "top_k must be"),
    ],
)
def test_a_first_frame_that_cannot_open_a_stream_ends_it(
    paced: RunningServer, model: str, params: dict[str, Any], status: str, words: str
) -> None:
    calls = Callbacks()
    client = tgrpc.InferenceServerClient(paced.grpc_target)
    client.start_stream(calls)
    try:
        client.async_stream_infer(model, [images_input([DIGIT])], request_id="0", parameters=params)
        (result, error), *_ = calls.wait(1)
    finally:
        client.stop_stream()
        client.close()
    assert result is None and error is not None and len(calls.got) == 1
    assert error.status() == status and words in str(error.message()), error


def test_a_client_that_stops_reading_is_cut_off(paced: RunningServer) -> None:
    def frames() -> Iterator[pb.ModelInferRequest]:
        for i in range(20_000):  # bounded: each is answered (superseded) and never read
            request = pb.ModelInferRequest(model_name="digits", id=str(i))
            request.inputs.add(name="IMAGE", datatype="BYTES", shape=[1]).contents.bytes_contents.append(DIGIT)
            yield request

    log = paced.log
    assert log is not None
    with grpc.insecure_channel(paced.grpc_target) as channel:
        stream = channel.stream_stream(
            method_path("ModelStreamInfer"),
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelStreamInferResponse.FromString,
        )
        call = stream(frames(), timeout=60)
        deadline = time.monotonic() + 30
        while "cut off" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        answers = 0
        with pytest.raises(grpc.RpcError) as ended:
            for _ in call:  # only now read: what was written before the cut, then the status
                answers += 1
    code, details = ended.value.code(), ended.value.details()
    print(f"\nnot reading: {answers} answers taken, then {code} ({details})")
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "answers unread" in details
    read = int(details.split(" frames read")[0])
    assert answers < read < 20_000  # cut off early, holding nothing per frame sent after
    a_new_stream_is_served(paced)  # and the server serves everyone else


def test_a_cancelled_stream_leaves_nothing_behind(paced: RunningServer) -> None:
    frames_before = metric_value(paced.url, "visionserve_stream_frames_total", model="digits")
    calls = Callbacks()
    client = tgrpc.InferenceServerClient(paced.grpc_target)
    client.start_stream(calls)
    for i in range(3):
        send(client, i, max_age_ms=5000)
    calls.wait_for(("1", "superseded"))  # 2 is read: the call is cancelled with 0 or 2 computing, 2 or none waiting
    client.stop_stream(cancel_requests=True)
    client.close()
    deadline = time.monotonic() + 30
    while metric_value(paced.url, "visionserve_streams_open", model="digits") > 0:
        assert time.monotonic() < deadline, "the cancelled stream is still counted open"
        time.sleep(0.1)
    # Every frame read is still counted, once, whatever the cancel cut short.
    frames = wait_for_metric(paced.url, "visionserve_stream_frames_total", frames_before + 3, model="digits")
    assert frames == frames_before + 3
    assert paced.log is not None and "Traceback" not in paced.log.read_text()
    a_new_stream_is_served(paced)


def test_a_stream_across_a_drain_ends_with_every_frame_read_answered(tmp_path: Path) -> None:
    server = _server(tmp_path, 100)
    calls = Callbacks()
    client = tgrpc.InferenceServerClient(server.grpc_target)
    sent = 0
    try:
        client.start_stream(calls)
        while sent < 400:  # 50 frames/s; the drain begins once frame 9 has been read
            if sent == 10:
                # Frame 9's answer (nothing sent after it supersedes it, so it comes) proves the server read it, a state
                # that lasts; a signal 20 ms after sending raced the server's read on a busy core.
                calls.wait_until(lambda fates: any(i == "9" for i, _ in fates))
                server.process.send_signal(signal.SIGTERM)
            try:
                send(client, sent, max_age_ms=5000)
            except InferenceServerException:  # the stream has ended: tritonclient refuses more
                break
            sent += 1
            time.sleep(0.02)
            if calls.got and calls.got[-1][1] is not None and not FRAME.match(str(calls.got[-1][1].message())):
                break
        exit_code = server.process.wait(60)
        client.stop_stream()
        client.close()
    finally:
        stop_server(server)
    *frames, (_, end) = calls.got
    assert end is not None and end.status() == "StatusCode.UNAVAILABLE", end
    read = int(str(end.message()).split(" frames read")[0])
    fates = [fate(*call) for call in frames]
    print(f"\nacross a drain: {sent} sent, {read} read, {fates}; end {end}; exit {exit_code}")
    assert "draining" in str(end.message()) and exit_code == 0
    assert sorted(int(i) for i, _ in fates) == list(range(read))  # every frame read has exactly one answer
    assert 10 <= read <= sent
    assert "result" in dict(fates).values() and set(dict(fates).values()) <= {"result", "superseded", "expired"}
