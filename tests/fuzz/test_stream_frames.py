"""Fuzzing the WebSocket stream's frames (issue 53): text frames (JSON headers of any shape, ``image_b64`` of any
value) and binary frames (any header length, any header, any bytes after it), to a classifier and a detector; and a
source's results WebSocket opened for ids of any characters.

Properties: every message gets exactly one answer, an error for one that is no usable frame, and never the end of
the session: a good frame sent after it is answered with its result. A results socket for a source that is not
there says so and closes 4404 (never a protocol error's 4500 or 1011).
"""

from __future__ import annotations

import base64
import json
import struct
from typing import Any
from urllib.parse import quote

import pytest
from hypothesis import given
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from service.inprocess import InProcessServer
from tests.conftest import encode_image, random_image
from tests.fuzz.conftest import ADMIN_TOKEN, fewer

IMAGE = encode_image(random_image(40, 40))
HUGE = "1" * 4301


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# A JSON value's text, of any type, at and past what JSON holds.
json_texts = st.one_of(
    st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", HUGE, "null", "true", '"x"', "[]", "{}", "0", "-1"]),
    st.integers(-(2**80), 2**80).map(str),
    st.floats().map(json.dumps),
    st.text(max_size=20).map(json.dumps),
    st.sampled_from([50, 500, 990, 5000, 100_000]).map(_nested),
    st.binary(max_size=8).map(lambda b: json.dumps(base64.b64encode(b).decode())),
)
header_keys = st.sampled_from(["id", "ts", "image_b64", "top_k", ""]) | st.text(max_size=5)


@st.composite
def headers(draw: st.DrawFn) -> str:
    """A header's text: a JSON object of any keys and values, or text that is not one."""
    if draw(st.integers(0, 4)) == 0:
        return draw(st.text(max_size=30) | json_texts)
    fields = draw(st.dictionaries(header_keys, json_texts, max_size=4))
    return "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in fields.items()) + "}"


@st.composite
def bad_frames(draw: st.DrawFn) -> str | bytes:
    """A text frame (a header), or a binary one: a 4-byte length of any value, a header, any bytes after."""
    header = draw(headers())
    if draw(st.booleans()):
        return header
    raw = header.encode("utf-8", "surrogatepass")
    length = draw(st.sampled_from([len(raw), 0, 1, 2**32 - 1]) | st.integers(0, len(raw) + 8))
    image = draw(st.binary(max_size=64) | st.just(IMAGE[:50]))
    cut = draw(st.sampled_from([None, 0, 1, 2, 3]))
    frame = struct.pack(">I", length) + raw + image
    return frame if cut is None else frame[:cut]


def _good() -> str:
    return json.dumps({"id": "good", "ts": 1, "image_b64": base64.b64encode(IMAGE).decode()})


@fewer(2)
@given(st.sampled_from(["digits", "digits-detect"]), st.lists(bad_frames(), min_size=1, max_size=3))
def test_a_bad_frame_is_its_own_error_and_the_next_frame_is_answered(
    served: InProcessServer, model: str, frames: list[str | bytes]
) -> None:
    url = f"{served.url.replace('http', 'ws', 1)}/v1/models/{model}/stream?max_age_ms=30000"
    answers: list[dict[str, Any]] = []
    with connect(url, open_timeout=30, max_size=None) as ws:
        for frame in frames:
            ws.send(frame)
        ws.send(_good())
        while not answers or answers[-1].get("id") != "good" or answers[-1]["status"] == "superseded":
            answers.append(json.loads(ws.recv(timeout=30)))  # a close here (ConnectionClosed) fails the property
    assert len(answers) == len(frames) + 1, answers
    assert answers[-1]["status"] == "result", answers[-1]
    for answer in answers[:-1]:
        assert answer["status"] in ("error", "superseded", "expired", "result"), answer
        if answer["status"] == "error":
            assert isinstance(answer["error"], str) and answer["error"], answer


@fewer(10)
@given(st.text(min_size=1, max_size=60) | st.sampled_from(["é" * 64, "\U0001f600" * 40, "a" * 200]))
def test_a_results_socket_for_no_such_source_closes_4404(served: InProcessServer, id: str) -> None:
    pytest.importorskip("av", reason="sources need PyAV (the video extra)")
    url = f"{served.url.replace('http', 'ws', 1)}/v1/sources/{quote(id, safe='')}/results?token={ADMIN_TOKEN}"
    try:
        ws = connect(url, open_timeout=30)
    except InvalidStatus as exc:  # an id holding '/' routes nowhere: the handshake is refused, never a 500
        assert 400 <= exc.response.status_code < 500, exc
        return
    with ws:
        first = json.loads(ws.recv(timeout=30))
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=30)
    assert first["status"] == "error" and "no source" in first["error"], first
    assert ws.close_code == 4404, (ws.close_code, ws.close_reason)
