"""Fuzzing every numeric request parameter at its edges, in process: the image API's query strings (through litestar
and the real ``classify`` route), the v2 JSON ``parameters`` (including the NaN and Infinity that Python's ``json``
writes), gRPC's ``InferParameter`` values, model versions, and the ``visionserve classify`` flags.

Properties: a value within its range is taken as sent; anything else (negative, zero where it is not allowed, past
64 bits, fractional for an integer, NaN, the infinities, a string or a boolean for a number) is refused with a
:class:`BadInputError` (a 400 over HTTP, a usage error for a flag) whose message names the parameter and its range;
nothing else is ever raised, and nothing is a 500.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
from collections.abc import Iterator
from decimal import Decimal
from typing import Any
from urllib.parse import urlencode

import pytest
from hypothesis import given
from hypothesis import strategies as st
from litestar import Litestar
from litestar.datastructures import State
from litestar.exceptions import HTTPException

import service.frontend.http  # noqa: F401  (before service.frontend.grpc, which imports it back: an import cycle)
from service.cli import build_parser
from service.core.arguments import integer_in, number_in
from service.core.errors import BadInputError, NotFoundError, VisionServeError
from service.core.parameters import MAX_INT, MAX_TIMEOUT_MS, classification_k, request_options, version_number
from service.core.protocol import pb
from service.core.tasks import Classify
from service.frontend.grpc.servicer import parameter_values
from service.frontend.http.errors import handle_http, handle_ours, handle_unexpected
from service.frontend.http.image_api import image_route
from service.frontend.http.v2 import parse_infer
from tests.fuzz.conftest import FUZZ, outcome
from tests.fuzz.test_multipart import AsgiClient

# The real classify route in an app of its own: litestar warns of its inferred path parameters once, as it does when
# the server starts; nothing this test checks.
pytestmark = pytest.mark.filterwarnings("ignore::litestar.exceptions.LitestarDeprecationWarning")
CLASSES = 10
# Numbers at and around every edge a parameter has, and far past them.
edges = st.sampled_from([0, 1, -1, 1000, 1001, MAX_INT, MAX_INT + 1, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1])
integers = st.integers(-(2**70), 2**70) | st.integers(-2, 1002) | edges
floats = st.floats() | st.floats(-2, 2) | st.sampled_from([math.nan, math.inf, -math.inf, 0.5, 2.0, -0.0, 1e300])
numbers = integers | floats | st.booleans()
anything = numbers | st.none() | st.text(max_size=8) | st.sampled_from(["NaN", "Infinity", "-Infinity", "1", "1e400"])


def _in_range(value: Any, low: float, high: float, *, integer: bool) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    if integer and not isinstance(value, int):
        return False
    return low <= value <= high  # False for NaN


# ---- v2 and gRPC parameters (one check for both) -----------------------------------------------------------------


@FUZZ
@given(anything, anything)
def test_timeout_and_priority_are_taken_in_range_or_refused_by_name(timeout: Any, priority: Any) -> None:
    params = {k: v for k, v in (("timeout", timeout), ("priority", priority)) if v is not None}
    result = outcome(lambda: request_options(params), (BadInputError,))
    timeout_ok = timeout is None or _in_range(timeout, 0, MAX_INT, integer=False)
    priority_ok = priority is None or _in_range(priority, 0, MAX_INT, integer=True)
    if isinstance(result, BadInputError):
        message = str(result)
        assert not (timeout_ok and priority_ok), message
        bad = "parameters.timeout" if not timeout_ok else "parameters.priority"
        assert message.startswith(f"{bad} must be ") and f" from 0 to {MAX_INT}" in message and ", got " in message
        return
    assert timeout_ok and priority_ok
    assert result == (priority or 0, timeout / 1000 if timeout else None)


@FUZZ
@given(anything)
def test_classification_k_is_taken_in_range_or_refused_by_name(k: Any) -> None:
    result = outcome(lambda: classification_k(k, CLASSES), (BadInputError,))
    if _in_range(k, 1, MAX_INT, integer=True):
        assert result == min(k, CLASSES)
    else:
        assert isinstance(result, BadInputError)
        assert str(result).startswith(f"classification must be an integer from 1 to {MAX_INT}")


@st.composite
def grpc_parameters(draw: st.DrawFn) -> tuple[pb.InferParameter, Any]:
    """An InferParameter of any kind, at any value its kind holds, and the value it holds."""
    kind = draw(st.sampled_from(["int64_param", "uint64_param", "double_param", "bool_param", "string_param"]))
    strategy = {
        "int64_param": st.integers(-(2**63), 2**63 - 1) | st.sampled_from([-(2**63), -1, 0, 2**63 - 1]),
        "uint64_param": st.integers(0, 2**64 - 1) | st.sampled_from([0, 2**63 - 1, 2**63, 2**64 - 1]),
        "double_param": floats,
        "bool_param": st.booleans(),
        "string_param": st.text(max_size=8) | st.sampled_from(["5", "NaN", "inf"]),
    }[kind]
    value = draw(strategy)
    param = pb.InferParameter(**{kind: value})
    return param, value


@FUZZ
@given(grpc_parameters(), grpc_parameters(), grpc_parameters())
def test_grpc_parameters_of_every_kind_are_checked_alike(
    timeout: tuple[pb.InferParameter, Any], priority: tuple[pb.InferParameter, Any], k: tuple[pb.InferParameter, Any]
) -> None:
    request = pb.ModelInferRequest()
    request.parameters["timeout"].CopyFrom(timeout[0])
    request.parameters["priority"].CopyFrom(priority[0])
    params = parameter_values(request.parameters)
    result = outcome(lambda: request_options(params), (BadInputError,))
    ok = _in_range(timeout[1], 0, MAX_INT, integer=False) and _in_range(priority[1], 0, MAX_INT, integer=True)
    assert isinstance(result, BadInputError) != ok, (params, result)
    output = request.outputs.add(name="LOGITS")
    output.parameters["classification"].CopyFrom(k[0])
    sent_k = parameter_values(output.parameters)["classification"]
    taken = outcome(lambda: classification_k(sent_k, CLASSES), (BadInputError,))
    assert isinstance(taken, BadInputError) != _in_range(k[1], 1, MAX_INT, integer=True), (sent_k, taken)


# ---- JSON as Python writes it -----------------------------------------------------------------------------------

json_numbers = floats | integers | st.sampled_from(["1e400", "-1e400", "1E+999", "NaN", "Infinity", "-Infinity"])


RANGES = {"timeout": (0, MAX_INT, False), "priority": (0, MAX_INT, True), "classification": (1, MAX_INT, True),
          "binary_data_size": (0, 1, True)}  # fmt: skip
TENSOR = '{"name": "INPUT", "datatype": "UINT8", "shape": [1, 1, 1, 1]'


def v2_body(name: str, literal: str) -> tuple[bytes, str | None]:
    """A v2 request whose parameter ``name`` is written ``literal``; binary_data_size with one byte to slice."""
    if name == "binary_data_size":
        head = f'{{"inputs": [{TENSOR}, "parameters": {{"binary_data_size": {literal}}}}}]}}'
        return head.encode() + b"\x07", str(len(head.encode()))
    tensor = TENSOR + ', "data": [7]}'
    if name == "classification":
        outputs = f'[{{"name": "LOGITS", "parameters": {{"classification": {literal}}}}}]'
        return f'{{"inputs": [{tensor}], "outputs": {outputs}}}'.encode(), None
    return f'{{"inputs": [{tensor}], "parameters": {{"{name}": {literal}}}}}'.encode(), None


@FUZZ
@given(st.sampled_from(sorted(RANGES)), json_numbers)
def test_json_numbers_of_any_spelling_are_taken_in_range_or_refused_by_name(name: str, value: Any) -> None:
    literal = value if isinstance(value, str) else json.dumps(value)  # Python's json: NaN and Infinity too
    body, header = v2_body(name, literal)

    def parse() -> Any:
        req, tensors = parse_infer(body, header)
        if name == "classification":
            return classification_k((req.outputs or [])[0].parameters["classification"], CLASSES)  # type: ignore[index]
        if name == "binary_data_size":
            return tensors[0].payload
        return request_options(req.parameters or {})

    result = outcome(parse, (BadInputError,))
    low, high, integer = RANGES[name]
    if _in_range(json.loads(literal), low, high, integer=integer):  # Python reads every spelling: 1e400 is inf
        assert not isinstance(result, BadInputError), (literal, result)
        return
    assert isinstance(result, BadInputError), (literal, result)
    message = str(result)
    assert name in message and " must be " in message and ", got " in message, message
    assert "from" in message or ">=" in message, message


# ---- model versions ---------------------------------------------------------------------------------------------


@FUZZ
@given(st.text(max_size=30) | integers.map(str) | floats.map(str) | st.sampled_from(["١", "1_0", " 1", "+1", "01"]))
def test_a_model_version_is_ascii_digits_in_range_or_refused(text: str) -> None:
    result = outcome(lambda: version_number(text), (BadInputError,))
    if text == "":
        assert result is None
    elif isinstance(result, BadInputError):
        assert "model version must be a positive integer" in str(result) and str(MAX_INT) in str(result)
        assert not (text.isascii() and text.isdigit() and 1 <= int(text) <= MAX_INT)
    else:
        assert text.isascii() and text.isdigit() and result == int(text) and 1 <= result <= MAX_INT


# ---- the image API's query strings, through litestar and the real route ------------------------------------------


class NoModels:
    """A server whose every model is unknown: a request that passes validation is answered 404, one refused by it
    400, and nothing reaches a model."""

    def slot(self, name: str, version: int | str | None = None) -> Any:
        raise NotFoundError(f"unknown model {name!r}")


APP = Litestar(
    route_handlers=[image_route(Classify)],
    exception_handlers={VisionServeError: handle_ours, HTTPException: handle_http, Exception: handle_unexpected},
    state=State({"server": NoModels()}),
    debug=False,
)
QUERY = {"top_k": (1, 1000, True), "priority": (0, MAX_INT, True), "timeout_ms": (0, MAX_TIMEOUT_MS, False)}
query_values = (
    numbers.map(str)
    | st.text(st.sampled_from("0123456789.-+eE_ xINFinfaN"), max_size=12)
    | st.sampled_from(["", "NaN", "nan", "inf", "Infinity", "-inf", "1e400", "1e-400", "0x10", "1_0", "1.0"])
)


@pytest.fixture(scope="module")
def client() -> Iterator[AsgiClient]:
    c = AsgiClient(APP)
    yield c
    c.close()


@FUZZ
@given(st.sampled_from(sorted(QUERY)), query_values)
def test_query_numbers_are_400_naming_the_parameter_and_range_or_pass(client: AsgiClient, name: str, sent: str) -> None:
    answer = client.post(
        "/v1/models/m/classify", b"", [(b"content-type", b"image/png")], urlencode({name: sent}).encode()
    )
    assert answer.status_code in (400, 404), (sent, answer.status_code, answer.text)
    low, high, integer = QUERY[name]
    if answer.status_code == 404:  # passed validation: the value is in range (exactly: floats round 2**63 - 1)
        value = Decimal(sent)
        assert value.is_finite() and (low < value if name == "timeout_ms" else low <= value), sent
        assert value <= Decimal(high) and (not integer or value == value.to_integral_value()), sent
        return
    message = answer.json()["error"]
    assert message.startswith(f"{name} must be ") and f", got {sent!r} (query parameter)" in message, message
    said = f"from {low} to {high}" if integer else "> 0 and <= 9223372036854776"
    assert said in message, message


# ---- the classify command line ------------------------------------------------------------------------------------

FLAGS = {
    "--version": (1, MAX_INT, True),
    "--top-k": (1, 1000, True),
    "--concurrency": (1, 1024, True),
    "--images-per-request": (1, 4096, True),
    "--max-attempts": (1, 1000, True),
    "--timeout": (0, 86400, False),
    "--max-retry-s": (0, 86400, False),
}
flag_values = (
    numbers.map(str) | st.text(max_size=10) | st.sampled_from(["nan", "inf", "-inf", "1e400", "1_0", "0x1", "1.0"])
)


@FUZZ
@given(st.sampled_from(sorted(FLAGS)), flag_values)
def test_classify_flags_take_their_range_or_are_a_usage_error_naming_the_flag(flag: str, text: str) -> None:
    parser = build_parser("classify")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            args = parser.parse_args(["classify", "--model", "m", "x.png", f"{flag}={text}"])
        except SystemExit as exc:
            assert exc.code == 2
            args = None
    low, high, integer = FLAGS[flag]
    if args is None:
        assert f"argument {flag}: must be " in err.getvalue(), err.getvalue()
        return
    value = getattr(args, flag.removeprefix("--").replace("-", "_"))
    assert math.isfinite(value) and low <= value <= high
    assert not integer or isinstance(value, int)
    if flag == "--timeout":
        assert value > 0


@FUZZ
@given(st.integers(-5, 5), st.integers(-5, 5), st.text(max_size=8) | integers.map(str) | floats.map(str))
def test_the_argparse_types_refuse_with_their_range(low: int, span: int, text: str) -> None:
    high = low + abs(span)
    for parse in (integer_in(low, high), number_in(low, high)):
        result = outcome(lambda p=parse: p(text), (argparse.ArgumentTypeError,))  # type: ignore[misc]
        if isinstance(result, argparse.ArgumentTypeError):
            assert str(result).startswith("must be ") and f"got {text!r}" in str(result)
        else:
            assert math.isfinite(result) and low <= result <= high
