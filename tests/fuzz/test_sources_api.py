"""Fuzzing ``/v1/sources`` (issue 53): ``POST`` bodies and ``PATCH`` bodies of a running classifier's and detector's
source, every field at wrong types, NaN, the infinities, numbers past float64 and past what ``int`` reads, deep
nesting, any unicode, long names and paths, unknown keys; and schemathesis over the routes' OpenAPI.

Properties: each answer is a 201 (a body that is right: the source is deleted again), a 400 whose error names a
field of the body (or says the body is no JSON object), a 404 for an unknown model, or a 503 at ``--max-sources``:
never a 500. A running source survives every refused ``PATCH`` with its options unchanged, and the server answers
the next request.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from service.frontend.sources.registry import COMMON_KEYS, changeable, task_keys
from service.inprocess import InProcessServer
from tests.fuzz.conftest import AUTH, NO_SURROGATES, fewer

pytest.importorskip("av", reason="sources need PyAV (the video extra)")

FIELDS = (*COMMON_KEYS, *task_keys())
CHANGEABLE = changeable()
HUGE = "1" * 4301  # one digit past what int() reads
# JSON literals no number field takes, as Python's json and a hand write them.
ODD_NUMBERS = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1e-999", HUGE, "-" + HUGE, str(2**64), "-0",
               "1.5", "0", "-1", "1e308", "5e-324", "241", "60001", "10001"]  # fmt: skip


def _nested(depth: int, kind: str) -> str:
    return ("[" * depth + "]" * depth) if kind == "list" else ('{"a":' * depth + "0" + "}" * depth)


scalars = st.one_of(
    st.sampled_from(ODD_NUMBERS),
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(json.dumps),
    st.sampled_from(["true", "false", "null", '""', '"0.5"', '"tcp"', '"udp"', '"answered"', '"xywh"', '"1"']),
    st.text(max_size=20).map(json.dumps),
    st.text(st.characters(codec="utf-8", blacklist_categories=NO_SURROGATES), max_size=20).map(
        lambda t: json.dumps(t, ensure_ascii=False)
    ),
    st.sampled_from(['"\\ud800"', '"\\u0000"', '"' + "é" * 5000 + '"', '"' + "a" * 70 + '"']),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3).map(lambda xs: "[" + ",".join(xs) + "]")
        | st.dictionaries(st.text(max_size=5).map(json.dumps), inner, max_size=3).map(
            lambda d: "{" + ",".join(f"{k}:{v}" for k, v in d.items()) + "}"
        )
    ),
    max_leaves=6,
) | st.builds(_nested, st.sampled_from([2, 64, 1000, 5000, 100_000]), st.sampled_from(["list", "dict"]))
URLS = st.sampled_from(['"http://127.0.0.1:9/x"', '"file:///clip.mp4"', '"rtsp://u:p@127.0.0.1:9/a?token=1"',
                        '"file:///' + "a" * 300 + '.mp4"', '"file:///' + "a/" * 3000 + '"', '"ftp://x/y"',
                        '"http://[::1"', '"http://cam:99999/"', '"http://' + "h" * 3000 + '"']) | values  # fmt: skip


# Bodies that are no JSON object: other JSON, broken JSON, no UTF-8, nothing, nesting past any parser's depth.
NO_OBJECTS = ["[]", "5", "{", "NaN", "\xff", "", _nested(100_000, "list"), _nested(100_000, "dict")]


@st.composite
def bodies(draw: st.DrawFn, keys: tuple[str, ...], *, create: bool) -> tuple[str, set[str]]:
    """A JSON object's text (its values any JSON, or past it) and its keys; on create, mostly with a usable url
    and model, so that the other fields are what is refused."""
    chosen = draw(st.lists(st.sampled_from(keys), unique=True, max_size=4))
    fields = {key: draw(values) for key in chosen}
    if create:
        if draw(st.booleans()):
            fields.setdefault("url", draw(URLS))
            fields.setdefault("model", draw(st.sampled_from(['"digits"', '"digits-detect"', '"nope"']) | values))
        if draw(st.integers(0, 9)) == 0:
            fields[draw(st.text(max_size=300))] = "1"  # a key no source has
    text = "{" + ",".join(f"{json.dumps(key)}:{value}" for key, value in fields.items()) + "}"
    return text, set(fields)


def _check(answer: Any, keys: set[str], body: str) -> None:
    assert answer.status_code in (200, 201, 400, 404, 503), (body[:500], answer.status_code, answer.text[:500])
    if answer.status_code != 400:
        return
    error = answer.json()["error"]
    assert len(error) < 2000, error[:500]
    # A URL's refusals say "source URL" or "url:"; a model's name, its version.
    named = [key for key in keys if key in error] + [w for w in ("url", "URL", "model", "version") if w in error]
    assert named or "the body" in error or "JSON object" in error, (body[:500], error)


@fewer(2)
@given(bodies(FIELDS, create=True) | st.sampled_from([(text, set()) for text in NO_OBJECTS]))
# Each was wrong before the fix named (issue 53): a 500 (nesting), or a 400 naming no field, or echoing 5,000
# characters.
@example((_nested(5000, "dict"), set()))  # sources_api._body: msgspec's RecursionError was a 500
@example(('{"url": "file:///clip.mp4", "model": "digits"}', {"url", "model"}))  # urls._check_file: "url: " named
@example(('{"id": "' + "é" * 5000 + '", "url": "http://127.0.0.1:9/x", "model": "digits"}', {"id", "url", "model"}))
def test_a_post_body_is_a_source_or_a_4xx_naming_the_field(served: InProcessServer, case: tuple[str, set[str]]) -> None:
    body, keys = case
    with served.client() as client:
        answer = client.post("/v1/sources", content=body.encode("utf-8", "surrogatepass"),
                             headers={**AUTH, "content-type": "application/json"})  # fmt: skip
        _check(answer, keys, body)
        if answer.status_code == 201:
            client.delete(f"/v1/sources/{answer.json()['id']}", headers=AUTH)


@pytest.fixture(scope="module")
def running(served: InProcessServer) -> Iterator[dict[str, dict[str, Any]]]:
    """A classifier's and a detector's source, running off an MJPEG camera in a thread; their documents."""
    from tests.sources.video import MjpegServer

    with MjpegServer(fps=2, width=32, height=24, max_frames=100_000) as camera, served.client() as client:
        docs = {}
        for model in ("digits", "digits-detect"):
            body = {"id": f"fuzz-{model}", "url": camera.url, "model": model, "max_age_ms": 5000}
            answer = client.post("/v1/sources", json=body, headers=AUTH)
            assert answer.status_code == 201, answer.text
            docs[model] = answer.json()
        try:
            yield docs
        finally:
            for model in docs:
                client.delete(f"/v1/sources/fuzz-{model}", headers=AUTH)


@fewer(2)
@given(st.sampled_from(["digits", "digits-detect"]), bodies((*CHANGEABLE, "url", "model", "id"), create=False))
def test_a_patch_body_changes_the_source_or_is_a_4xx_naming_the_field(
    served: InProcessServer, running: dict[str, dict[str, Any]], model: str, case: tuple[str, set[str]]
) -> None:
    body, keys = case
    id = f"fuzz-{model}"
    with served.client() as client:
        before = client.get(f"/v1/sources/{id}", headers=AUTH).json()
        answer = client.patch(f"/v1/sources/{id}", content=body.encode("utf-8", "surrogatepass"),
                              headers={**AUTH, "content-type": "application/json"})  # fmt: skip
        _check(answer, keys, body)
        after = client.get(f"/v1/sources/{id}", headers=AUTH).json()
        assert after["state"] not in ("failed", "stopped"), after  # a refused change ends nothing
        if answer.status_code == 400:
            assert after["options"] == before["options"], (body[:500], before, after)
        else:
            # Back to the options it had, for the next example (a change of each to its own value is taken).
            restore = {k: v for k, v in before["options"].items() if k in CHANGEABLE}
            assert client.patch(f"/v1/sources/{id}", json=restore, headers=AUTH).status_code == 200


def test_schemathesis_finds_no_server_error_on_the_sources_routes(served: InProcessServer) -> None:
    """The OpenAPI routes of ``/v1/sources`` (POST, GET, PATCH, DELETE), with the admin token: no 500."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    st_ = shutil.which("st") or str(Path(sys.executable).with_name("st"))
    started = time.monotonic()
    proc = subprocess.run(
        [st_, "run", f"{served.url}/schema/openapi.json", "--include-path-regex", "^/v1/sources",
         "--exclude-path-regex", "/results$", "--header", f"Authorization: {AUTH['Authorization']}",
         "--checks", "not_a_server_error", "--max-examples", "15", "--request-timeout", "30",
         "--generation-deterministic", "--no-color"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert " passed" in proc.stdout, proc.stdout[-2000:]
    print(f"schemathesis over /v1/sources: {time.monotonic() - started:.1f} s\n{proc.stdout[-1500:]}")
