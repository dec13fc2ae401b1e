"""Fuzzing the KServe v2 / Triton binary tensor extension: the split of a body into its JSON header and binary part
(``Inference-Header-Content-Length``), the inputs' ``binary_data_size`` slices, BYTES elements (4-byte
little-endian length prefixes), pixel tensors, and the compressed bodies they may arrive in.

Properties: a request built as tritonclient builds it parses back to what was sent; anything else (arbitrary bytes,
a valid request with a field, length or byte changed) is refused with a :class:`BadInputError` and nothing else,
without allocating more than a small multiple of what was sent. A header length of 0 is Triton's raw binary request:
the whole body is the one input's data, taken as it is or refused.
"""

from __future__ import annotations

import gzip
import struct
import zlib
from functools import partial
from typing import Any

import msgspec
import numpy as np
from hypothesis import assume, given
from hypothesis import strategies as st
from tritonclient.utils import serialize_byte_tensor

from service.core.errors import BadInputError, PayloadTooLargeError
from service.frontend import protocol
from service.frontend.http.body import inflate
from service.frontend.http.v2 import parse_infer
from service.frontend.protocol import Tensor
from tests.fuzz.conftest import FUZZ, outcome, peak_bytes

DIMS = [1, 2, 3]  # [C, H, W] of the pixel tensors below: small, so a batch is a few bytes
PIXELS_PER_IMAGE = 6
# Slack for what a parse may allocate beyond a multiple of its input (Python objects, msgspec's buffers).
FIXED_BYTES = 256 * 1024


def encode_bytes(elements: list[bytes]) -> bytes:
    """A BYTES tensor in binary form, as the extension defines it (4-byte little-endian length, then the bytes)."""
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=20,
)


@st.composite
def input_tensors(draw: st.DrawFn) -> dict[str, Any]:
    """One input as a client builds it: BYTES images or UINT8/FP32 pixels, binary or JSON."""
    kind = draw(st.sampled_from(["BYTES", "UINT8", "FP32"]))
    binary = draw(st.booleans())
    if kind == "BYTES":
        elements = draw(st.lists(st.binary(max_size=40), max_size=6))
        entry: dict[str, Any] = {"name": "IMAGE", "datatype": "BYTES", "shape": [len(elements)]}
        return {"entry": entry, "binary": binary, "elements": elements}
    n = draw(st.integers(1, 4))
    values = draw(st.lists(st.integers(0, 255), min_size=n * PIXELS_PER_IMAGE, max_size=n * PIXELS_PER_IMAGE))
    array = np.array(values, dtype=np.uint8).reshape([n, *DIMS])
    entry = {"name": "INPUT", "datatype": kind, "shape": [n, *DIMS]}
    return {"entry": entry, "binary": binary, "array": array}


@st.composite
def requests(draw: st.DrawFn) -> tuple[bytes, str | None, list[dict[str, Any]]]:
    """(body, Inference-Header-Content-Length or None, the inputs as built) for a valid request."""
    inputs = draw(st.lists(input_tensors(), min_size=1, max_size=3))
    entries, blobs = [], []
    for item in inputs:
        entry = dict(item["entry"])
        if item["entry"]["datatype"] == "BYTES":
            # tritonclient's own encoder for BYTES: what its clients put on the wire
            elements = item["elements"]
            blob = serialize_byte_tensor(np.array(elements, dtype=np.object_)).item() if elements else b""
            json_data: Any = [e.decode("latin-1") for e in item["elements"]]
        else:
            dtype = "<f4" if entry["datatype"] == "FP32" else np.uint8
            blob = item["array"].astype(dtype).tobytes()
            json_data = item["array"].astype(float if entry["datatype"] == "FP32" else int).ravel().tolist()
        if item["binary"]:
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = json_data
        item["blob"], item["json"] = blob, json_data
        entries.append(entry)
    header = msgspec.json.encode({"id": draw(st.text(max_size=8)), "inputs": entries})
    if not blobs and draw(st.booleans()):
        return header, None, inputs
    return header + b"".join(blobs), str(len(header)), inputs


def consume(tensor: Tensor) -> Any:
    """What the server does with a parsed input next (``protocol.infer`` up to the decode)."""
    if tensor.name == protocol.IMAGE:
        return protocol.images_from(tensor)
    return protocol.pixels_from(tensor, DIMS)


RAW = {view: partial(protocol.raw_tensor, view, DIMS) for view in (protocol.IMAGE, protocol.TENSOR)}


def parse_and_consume(body: bytes, header: str | None, view: str = protocol.TENSOR) -> list[Any]:
    _, tensors = parse_infer(body, header, RAW[view])
    return [outcome(partial(consume, t), (BadInputError,)) for t in tensors]


# ---- BYTES elements ---------------------------------------------------------------------------------------------


@FUZZ
@given(st.lists(st.binary(max_size=300), max_size=30))
def test_bytes_elements_round_trip_tritonclient_encoding(elements: list[bytes]) -> None:
    raw = encode_bytes(elements)
    if elements:  # tritonclient's encoder agrees with the definition this test encodes by
        assert serialize_byte_tensor(np.array(elements, dtype=np.object_)).item() == raw
    assert protocol.bytes_elements(raw, len(elements)) == elements


@FUZZ
@given(st.binary(max_size=400), st.integers(-2, 2**40))
def test_bytes_elements_of_arbitrary_bytes_parse_exactly_or_are_refused(raw: bytes, count: int) -> None:
    with peak_bytes() as peak:
        result = outcome(lambda: protocol.bytes_elements(raw, count), (BadInputError,))
    assert peak[0] < 16 * len(raw) + FIXED_BYTES
    if not isinstance(result, BadInputError):
        assert len(result) == count and encode_bytes(result) == raw


@FUZZ
@given(st.lists(st.binary(max_size=50), min_size=1, max_size=10), st.data())
def test_bytes_elements_refuse_truncation_and_a_wrong_count(elements: list[bytes], data: st.DataObject) -> None:
    raw = encode_bytes(elements)
    cut = data.draw(st.integers(0, len(raw) - 1), label="cut")
    truncated = outcome(lambda: protocol.bytes_elements(raw[:cut], len(elements)), (BadInputError,))
    # A cut on an element boundary leaves fewer elements than the shape says: refused all the same.
    assert isinstance(truncated, BadInputError)
    wrong = data.draw(st.integers(-1, len(elements) + 2).filter(lambda n: n != len(elements)), label="count")
    assert isinstance(outcome(lambda: protocol.bytes_elements(raw, wrong), (BadInputError,)), BadInputError)


@FUZZ
@given(st.integers(1, 2**32 - 1), st.binary(max_size=64))
def test_a_huge_declared_element_length_is_refused_before_allocating(length: int, rest: bytes) -> None:
    assume(length > len(rest))
    raw = struct.pack("<I", length) + rest
    with peak_bytes() as peak:
        result = outcome(lambda: protocol.bytes_elements(raw, 1), (BadInputError,))
    assert isinstance(result, BadInputError) and "ends inside an element" in str(result)
    assert peak[0] < FIXED_BYTES


# ---- whole requests -----------------------------------------------------------------------------------------------


@FUZZ
@given(requests())
def test_a_request_built_like_tritonclient_parses_back_to_what_was_sent(
    built: tuple[bytes, str | None, list[dict[str, Any]]],
) -> None:
    body, header, inputs = built
    _, tensors = parse_infer(body, header)
    assert [t.name for t in tensors] == [i["entry"]["name"] for i in inputs]
    for tensor, item in zip(tensors, inputs, strict=True):
        assert tensor.datatype == item["entry"]["datatype"] and tensor.shape == item["entry"]["shape"]
        assert tensor.payload == (item["blob"] if item["binary"] else item["json"])
        if tensor.name == protocol.IMAGE:
            if item["binary"]:
                assert protocol.images_from(tensor) == item["elements"]
        else:
            np.testing.assert_array_equal(protocol.pixels_from(tensor, DIMS), item["array"])


@FUZZ
@given(
    st.binary(max_size=600),
    st.none() | st.text(max_size=12) | st.integers(-5, 10**6).map(str) | st.just("0"),
    st.sampled_from(sorted(RAW)),
)
def test_arbitrary_bodies_are_refused_with_bad_input_only(body: bytes, header: str | None, view: str) -> None:
    with peak_bytes() as peak:
        outcome(lambda: parse_and_consume(body, header, view), (BadInputError,))
    assert peak[0] < 16 * len(body) + FIXED_BYTES


@FUZZ
@given(st.binary(max_size=3 * PIXELS_PER_IMAGE) | st.binary(min_size=PIXELS_PER_IMAGE, max_size=PIXELS_PER_IMAGE))
def test_a_raw_binary_request_is_the_whole_body_as_the_one_input(body: bytes) -> None:
    """Inference-Header-Content-Length: 0, as Triton reads it: no JSON, batch 1, outputs answered binary."""
    req, [image] = parse_infer(body, "0", RAW[protocol.IMAGE])
    assert req.parameters == {"binary_data_output": True} and req.outputs is None
    assert protocol.images_from(image) == [body]  # one encoded image file: the body, whatever it holds
    pixels = outcome(lambda: parse_infer(body, "0", RAW[protocol.TENSOR])[1][0], (BadInputError,))
    if len(body) != PIXELS_PER_IMAGE:  # fixed dims: exactly one image's C*H*W bytes, as Triton deduces no other shape
        assert isinstance(pixels, BadInputError) and "[1, 1, 2, 3]: 6 bytes" in str(pixels)
    else:
        np.testing.assert_array_equal(protocol.pixels_from(pixels, DIMS).ravel(), np.frombuffer(body, np.uint8))


MUTATIONS = ["truncate", "flip", "insert", "header", "field", "size", "shape"]


@st.composite
def mutated_requests(draw: st.DrawFn) -> tuple[bytes, str | None]:
    """A valid request with one thing wrong: a byte, the header length, or one field of the JSON."""
    body, header, _ = draw(requests())
    how = draw(st.sampled_from(MUTATIONS), label="mutation")
    n = int(header) if header is not None else len(body)
    if how == "truncate":
        return body[: draw(st.integers(0, len(body) - 1))], header
    if how == "flip":
        i = draw(st.integers(0, len(body) - 1))
        return body[:i] + bytes([body[i] ^ draw(st.integers(1, 255))]) + body[i + 1 :], header
    if how == "insert":
        i = draw(st.integers(0, len(body)))
        return body[:i] + draw(st.binary(min_size=1, max_size=8)) + body[i:], header
    if how == "header":
        return body, draw(st.integers(-2, len(body) + 2).map(str) | st.sampled_from(["", " 1", "1e3", "0x10", "-0"]))
    doc = msgspec.json.decode(body[:n])
    entry = doc["inputs"][draw(st.integers(0, len(doc["inputs"]) - 1))]
    if how == "field":
        entry[draw(st.sampled_from(["name", "datatype", "shape", "data", "parameters"]))] = draw(json_values)
    elif how == "size":
        entry.setdefault("parameters", {})["binary_data_size"] = draw(
            st.integers(-2, 2**64) | st.floats(allow_nan=False, allow_infinity=False) | json_values
        )
    else:
        entry["shape"] = draw(st.lists(st.integers(-2, 2**63 - 1) | st.integers(-2, 8), max_size=5))
    header_json = msgspec.json.encode(doc)
    return header_json + body[n:], str(len(header_json)) if header is not None else None


@FUZZ
@given(mutated_requests())
def test_a_mutated_request_is_parsed_consistently_or_refused_with_bad_input_only(
    mutated: tuple[bytes, str | None],
) -> None:
    body, header = mutated
    with peak_bytes() as peak:
        parsed = outcome(lambda: parse_infer(body, header, RAW[protocol.TENSOR]), (BadInputError,))
        if isinstance(parsed, BadInputError):
            return
        results = [outcome(partial(consume, t), (BadInputError,)) for t in parsed[1]]
    assert peak[0] < 16 * len(body) + FIXED_BYTES
    for tensor, result in zip(parsed[1], results, strict=True):
        if isinstance(result, BadInputError):
            continue
        if tensor.name == protocol.IMAGE:
            assert len(result) == tensor.shape[0]
        else:  # accepted pixels are exactly the declared shape, every dimension as declared
            assert list(result.shape) == tensor.shape and result.dtype == np.uint8


# ---- pixel tensors in JSON ---------------------------------------------------------------------------------------

numbers = (
    st.integers(-(2**70), 2**70)
    | st.integers(-2, 300)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.floats(-1, 256)
    | st.booleans()
)


@FUZZ
@given(
    st.sampled_from(["UINT8", "FP32"]),
    st.integers(-2, 3),
    st.lists(numbers, max_size=3 * PIXELS_PER_IMAGE),
)
def test_json_pixels_are_taken_exactly_or_refused(datatype: str, n: int, values: list[Any]) -> None:
    tensor = Tensor("INPUT", datatype, [n, *DIMS], list(values))
    result = outcome(lambda: protocol.pixels_from(tensor, DIMS), (BadInputError,))
    if isinstance(result, BadInputError):
        return
    assert list(result.shape) == [n, *DIMS]
    sent = np.array([float(v) for v in values])
    if datatype == "UINT8":  # UINT8 takes the integers 0..255 as they are: nothing rounded, wrapped or clipped
        np.testing.assert_array_equal(result.ravel().astype(float), sent)
    else:
        np.testing.assert_array_equal(result.ravel(), np.rint(sent.astype(np.float32)).astype(np.uint8))


@FUZZ
@given(st.integers(2, 2**62), st.binary(max_size=64))
def test_a_huge_declared_batch_is_refused_before_allocating(n: int, raw: bytes) -> None:
    assume(n * PIXELS_PER_IMAGE != len(raw))
    tensor = Tensor("INPUT", "UINT8", [n, *DIMS], raw)
    with peak_bytes() as peak:
        result = outcome(lambda: protocol.pixels_from(tensor, DIMS), (BadInputError,))
    assert isinstance(result, BadInputError)
    assert peak[0] < FIXED_BYTES


# ---- compressed bodies ---------------------------------------------------------------------------------------------

ENCODERS = {
    "gzip": lambda b: gzip.compress(b, mtime=0),
    "x-gzip": lambda b: gzip.compress(b, mtime=0),
    "deflate": zlib.compress,
    "identity": lambda b: b,
}


@FUZZ
@given(st.sampled_from(sorted(ENCODERS)), st.binary(max_size=2000))
def test_compressed_bodies_round_trip(encoding: str, body: bytes) -> None:
    assert inflate(ENCODERS[encoding](body), encoding, limit=len(body) + 1) == body


@FUZZ
@given(st.sampled_from(["gzip", "deflate"]), st.binary(max_size=400))
def test_arbitrary_compressed_bodies_are_refused_with_bad_input_only(encoding: str, body: bytes) -> None:
    outcome(lambda: inflate(body, encoding, limit=1 << 16), (BadInputError,))


@FUZZ
@given(st.sampled_from(["gzip", "deflate"]), st.lists(st.binary(max_size=200), min_size=2, max_size=4))
def test_a_body_is_never_silently_cut_short(encoding: str, parts: list[bytes]) -> None:
    """Concatenated gzip members are one gzip body (RFC 1952); anything after a zlib stream is refused, not
    dropped: a cut body would reach the parser as a different request."""
    body = b"".join(ENCODERS[encoding](p) for p in parts)
    result = outcome(lambda: inflate(body, encoding, limit=1 << 16), (BadInputError,))
    if not isinstance(result, BadInputError):
        assert result == b"".join(parts)


@FUZZ
@given(st.sampled_from(["gzip", "deflate"]), st.integers(1, 64))
def test_a_compression_bomb_costs_at_most_the_limit(encoding: str, ratio: int) -> None:
    limit = 1 << 16
    bomb = ENCODERS[encoding](bytes(limit * ratio + 1))
    with peak_bytes() as peak:
        result = outcome(lambda: inflate(bomb, encoding, limit=limit), (BadInputError,))
    assert isinstance(result, PayloadTooLargeError)
    assert peak[0] < 4 * limit + (2 << 20)  # the limit plus a chunk, never the whole expansion
