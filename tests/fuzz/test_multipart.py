"""Fuzzing the image API's request reader (:func:`service.frontend.http.image_api.read_images`): multipart forms and
raw image bodies, through litestar's own multipart parser, in process.

The app here is the real reader behind the real error handlers (``service.frontend.http.errors``), without a model:
it answers with what it read. Properties: a form built as a browser or httpx builds it is read back file by file,
in order, with each file's name; anything else (arbitrary bodies, a valid form with bytes changed, any
Content-Type) is answered 400, 413 or 415 with an error message, never a 500.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from litestar import Litestar, Request, post
from litestar.exceptions import HTTPException

from service.core.errors import VisionServeError
from service.frontend.http.errors import handle_http, handle_ours, handle_unexpected
from service.frontend.http.image_api import read_images
from tests.fuzz.conftest import FUZZ

MAX_IMAGES = 4
MAX_BODY_BYTES = 1 << 16
REFUSED = {400, 413, 415}


@post("/read", status_code=200)
async def read(request: Request[Any, Any, Any]) -> dict[str, Any]:
    images, names, single = await read_images(request, MAX_IMAGES)
    return {"images": [i.hex() for i in images], "names": names, "single": single}


APP = Litestar(
    route_handlers=[read],
    exception_handlers={VisionServeError: handle_ours, HTTPException: handle_http, Exception: handle_unexpected},
    request_max_body_size=MAX_BODY_BYTES,
    debug=False,
)


@dataclass
class Answer:
    status_code: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode(errors="replace")


class AsgiClient:
    """Posts straight into the ASGI app on one event loop: a tenth of a TestClient request's cost, so the examples
    fit the CI budget. The app, its routing and its error handlers are the real ones; only the socket is missing."""

    def __init__(self, app: Litestar) -> None:
        self.app = app
        self.runner = asyncio.Runner()

    def post(self, path: str, body: bytes, headers: list[tuple[bytes, bytes]], query: bytes = b"") -> Answer:
        return self.runner.run(self._post(path, body, headers, query))

    async def _post(self, path: str, body: bytes, headers: list[tuple[bytes, bytes]], query: bytes = b"") -> Answer:
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": path, "raw_path": path.encode(), "root_path": "", "query_string": query,
            "headers": [(b"host", b"test"), (b"content-length", str(len(body)).encode()), *headers],
            "client": ("127.0.0.1", 1), "server": ("test", 80), "state": {},
        }  # fmt: skip
        sent = False
        status, chunks = 0, []

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if sent:
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self.app(scope, receive, send)  # type: ignore[arg-type]
        return Answer(status, b"".join(chunks))

    def close(self) -> None:
        self.runner.close()


@pytest.fixture(scope="module")
def client() -> Iterator[AsgiClient]:
    c = AsgiClient(APP)
    yield c
    c.close()


safe_text = st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyzABCDEFGHIJ0123456789_-. "), min_size=1, max_size=12)
boundaries = st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyz0123456789'()+_,-./:=?"), min_size=8, max_size=40)


@st.composite
def parts(draw: st.DrawFn) -> dict[str, Any]:
    """One form part: a file (with a filename) or a text field."""
    if draw(st.booleans()):
        return {
            "name": draw(safe_text),
            "filename": draw(safe_text.filter(lambda s: s.strip() != "")),
            "type": draw(st.sampled_from(["image/png", "image/jpeg", "application/octet-stream", None])),
            "data": draw(st.binary(max_size=200)),
        }
    return {"name": draw(safe_text), "filename": None, "type": None, "data": draw(st.text(max_size=40)).encode()}


def form_body(items: list[dict[str, Any]], boundary: str) -> bytes:
    """multipart/form-data as RFC 7578 (and every browser) writes it."""
    out = b""
    for part in items:
        disposition = f'form-data; name="{part["name"]}"'
        if part["filename"] is not None:
            disposition += f'; filename="{part["filename"]}"'
        out += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n".encode()
        if part["type"]:
            out += f"Content-Type: {part['type']}\r\n".encode()
        out += b"\r\n" + part["data"] + b"\r\n"
    return out + f"--{boundary}--\r\n".encode()


def post_form(client: AsgiClient, body: bytes, content_type: str) -> Answer:
    return client.post("/read", body, [(b"content-type", content_type.encode("latin-1"))])


def assert_refused_cleanly(response: Answer) -> None:
    assert response.status_code in REFUSED, (response.status_code, response.text)
    assert response.json()["error"]


@FUZZ
@given(st.lists(parts(), max_size=7), boundaries)
def test_a_well_formed_form_is_read_back_file_by_file(
    client: AsgiClient, items: list[dict[str, Any]], boundary: str
) -> None:
    assume(all(f"--{boundary}".encode() not in p["data"] for p in items))
    files = [p for p in items if p["filename"] is not None]
    response = post_form(client, form_body(items, boundary), f'multipart/form-data; boundary="{boundary}"')
    if not files:
        assert response.status_code == 400 and "holds no files" in response.json()["error"]
    elif len(files) > MAX_IMAGES:
        assert response.status_code == 413 and f"over the limit of {MAX_IMAGES}" in response.json()["error"]
    else:
        assert response.status_code == 200, response.text
        got = response.json()
        assert [bytes.fromhex(i) for i in got["images"]] == [f["data"] for f in files]
        assert got["names"] == [f["filename"] for f in files] and got["single"] is False


@FUZZ
@given(st.binary(max_size=600), boundaries)
def test_an_arbitrary_multipart_body_is_refused_cleanly(client: AsgiClient, body: bytes, boundary: str) -> None:
    response = post_form(client, body, f'multipart/form-data; boundary="{boundary}"')
    if response.status_code != 200:
        assert_refused_cleanly(response)


@st.composite
def mutated_forms(draw: st.DrawFn) -> tuple[bytes, str]:
    items = draw(st.lists(parts(), min_size=1, max_size=4))
    boundary = draw(boundaries)
    body = form_body(items, boundary)
    how = draw(st.sampled_from(["truncate", "flip", "insert", "header"]))
    i = draw(st.integers(0, len(body) - 1))
    if how == "truncate":
        body = body[:i]
    elif how == "flip":
        body = body[:i] + bytes([body[i] ^ draw(st.integers(1, 255))]) + body[i + 1 :]
    elif how == "insert":
        body = (
            body[:i]
            + draw(st.binary(min_size=1, max_size=16) | st.sampled_from([b"\r\n", b'"', b";", b"--"]))
            + body[i:]
        )
    else:  # a header line of a part replaced by arbitrary bytes
        lines = body.split(b"\r\n")
        j = draw(st.integers(0, len(lines) - 1))
        lines[j] = draw(st.binary(max_size=60) | st.text(max_size=60).map(str.encode))
        body = b"\r\n".join(lines)
    return body, boundary


@FUZZ
@given(mutated_forms())
def test_a_mutated_form_is_read_or_refused_cleanly(client: AsgiClient, form: tuple[bytes, str]) -> None:
    body, boundary = form
    response = post_form(client, body, f'multipart/form-data; boundary="{boundary}"')
    if response.status_code != 200:
        assert_refused_cleanly(response)


content_types = (
    st.text(max_size=60)
    | st.sampled_from(["multipart/form-data", "multipart/form-data; boundary=", "multipart/form-data; boundary=\"\""])
    | st.builds(lambda t, p: f"{t}; {p}", st.sampled_from(["multipart/form-data", "image/png", "text/plain"]),
                st.text(max_size=40))
)  # fmt: skip


@FUZZ
@given(content_types, st.binary(max_size=200))
def test_any_content_type_is_read_or_refused_cleanly(client: AsgiClient, ctype: str, body: bytes) -> None:
    assume(all(ord(c) < 256 for c in ctype))  # a header is bytes: latin-1 at most
    response = post_form(client, body, ctype)
    if response.status_code == 200:
        assert response.json()["single"] is True and bytes.fromhex(response.json()["images"][0]) == body
    else:
        assert_refused_cleanly(response)


@FUZZ
@given(st.binary(min_size=1, max_size=300), st.sampled_from(["image/png", "image/jpeg", "image/webp", "image/bmp"]))
def test_a_raw_image_body_is_read_as_one_image(client: AsgiClient, body: bytes, ctype: str) -> None:
    response = post_form(client, body, ctype)
    assert response.status_code == 200, response.text
    assert response.json() == {"images": [body.hex()], "names": [None], "single": True}
