"""The one request path (:mod:`service.frontend.request`) and the classification task, in process: what every
protocol's answer is built from. The protocols themselves are tested against real servers (test_v2, test_grpc,
test_image_api, test_streams)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from service.core.errors import BadInputError, VisionServeError
from service.core.status import InferResult
from service.core.tasks import Classify, ClassifyOptions, OutputTensor, Want, Wanted
from service.frontend import request as path
from service.frontend.timing import Timing

LABELS = ("cat", "dog", "owl")
LOGITS = np.array([[0.1, 2.0, -1.0], [3.0, 0.0, 1.0]], dtype=np.float32)


class Version:
    model, version = "m", 1


class FakeSlot:
    """What the path asks of a model version: decode (a b"bad" image fails), infer (the rows of LOGITS), observe."""

    name = "m"
    version = Version()
    task = Classify(SimpleNamespace(labels=LABELS, num_classes=len(LABELS)))  # type: ignore[arg-type]

    def __init__(self, answered: int = 0, row_errors: list[VisionServeError | None] | None = None) -> None:
        self.answered = answered
        self.row_errors = row_errors
        self.observed: list[str] = []
        self.batches: list[int] = []

    async def decode(self, images: list[bytes], timing: Any) -> tuple[list[Any], list[Any]]:
        decoded = [BadInputError("not an image") if d == b"bad" else np.zeros((3, 2, 2), np.uint8) for d in images]
        return decoded, [None] * len(images)  # and each image's transform (none: a classifier ignores them)

    async def infer(self, batch: Any, timing: Any, **options: Any) -> InferResult:
        n = len(batch)
        self.batches.append(n)
        errors = self.row_errors[:n] if self.row_errors is not None else [None] * n
        return InferResult({"logits": LOGITS[:n]}, errors, version=self.answered)

    @contextlib.contextmanager
    def observe(self, timing: Any, protocol: str = "http") -> Iterator[None]:
        self.observed.append(protocol)
        yield


def where(slot: FakeSlot) -> path.Target:
    return path.Target(slot, "m", path.TENSOR, "")  # type: ignore[arg-type]


def run(slot: FakeSlot, ask: path.Ask, observe: str | None = None) -> path.Answer:
    return asyncio.run(path.run(where(slot), ask, Timing(), lambda answer: answer, observe))


def test_classify_builds_logits_and_classification_outputs_alike_for_every_wire() -> None:
    task = Classify(SimpleNamespace(labels=LABELS, num_classes=len(LABELS)))  # type: ignore[arg-type]
    wanted = task.wanted([("LOGITS", {}), ("LOGITS", {"classification": 9, "binary_data": True})])
    assert wanted == (Wanted("LOGITS"), Wanted("LOGITS", 3, True))  # k capped at the classes, as Triton caps it
    post = task.postprocess(InferResult({"logits": LOGITS}, [None, None]), Want(wanted))
    logits, strings = post.tensors
    assert (logits.datatype, logits.shape, logits.values()) == ("FP32", [2, 3], LOGITS.ravel().tolist())
    assert logits.raw() == LOGITS.astype("<f4").tobytes()
    assert (strings.datatype, strings.shape) == ("BYTES", [2, 3])
    assert strings.values()[0] == "2.000000:1:dog" and strings.values()[3] == "3.000000:0:cat"
    assert strings.raw().startswith(len(b"2.000000:1:dog").to_bytes(4, "little") + b"2.000000:1:dog")
    assert post.predictions == []  # v2 outputs asked: no rows
    rows = task.postprocess(InferResult({"logits": LOGITS}, [None, None]), Want(options=ClassifyOptions(top_k=1)))
    assert [p[0]["label"] for p in rows.predictions] == ["dog", "cat"]


def test_an_unknown_output_or_a_bad_k_is_refused_before_any_work() -> None:
    task = Classify(SimpleNamespace(labels=LABELS, num_classes=len(LABELS)))  # type: ignore[arg-type]
    with pytest.raises(BadInputError, match="unknown output 'BOXES'"):
        task.wanted([("BOXES", {})])
    with pytest.raises(BadInputError, match=r"outputs\[0\].parameters.classification must be"):
        task.wanted([("LOGITS", {"classification": 0})])
    assert task.wanted([]) == (Wanted("LOGITS"),)  # none named: the logits


def test_the_answer_names_the_version_that_computed_it() -> None:
    slot = FakeSlot(answered=2)  # a canary's candidate answered for version 1
    assert (
        run(slot, path.Ask(Want(options=ClassifyOptions(top_k=1)), pixels=np.zeros((1, 3, 2, 2), np.uint8))).version
        == 2
    )
    assert path.answered_version(slot, 0) == 1  # 0: the version asked


def test_each_image_is_answered_in_its_place_when_asked_so() -> None:
    slot = FakeSlot()
    answer = run(slot, path.Ask(Want(options=ClassifyOptions(top_k=1)), [b"ok", b"bad", b"ok"], each=True))
    assert slot.batches == [2]  # only the decoded images are computed
    assert [str(e) if e else None for e in answer.errors] == [None, "not an image", None]
    assert answer.predictions[1] is None and answer.predictions[0] and answer.predictions[2]


def test_a_bad_image_fails_the_whole_request_naming_it_or_not() -> None:
    with pytest.raises(BadInputError, match=r"^image 1: not an image \(hint\)$"):
        run(FakeSlot(), path.Ask(Want(), [b"ok", b"bad"], named=True, hint=" (hint)"))
    with pytest.raises(BadInputError, match=r"^not an image$"):
        run(FakeSlot(), path.Ask(Want(), [b"bad"]))
    failed = FakeSlot(row_errors=[None, VisionServeError("compute failed")])
    with pytest.raises(VisionServeError, match=r"^image 1: compute failed$"):
        run(failed, path.Ask(Want(), pixels=np.zeros((2, 3, 2, 2), np.uint8), named=True))


def test_a_frame_is_observed_at_the_engine_step_and_expires_after_its_decode() -> None:
    slot = FakeSlot()
    answer = run(
        slot,
        path.Ask(Want(options=ClassifyOptions(top_k=2)), [b"ok"], each=True, expires=time.perf_counter() + 60),
        "stream",
    )
    assert slot.observed == ["stream"] and len(answer.predictions[0] or []) == 2
    with pytest.raises(path.Expired) as expired:
        run(slot, path.Ask(Want(), [b"ok"], each=True, expires=time.perf_counter() - 1), "stream")
    assert expired.value.stage == "decode" and slot.batches == [1]  # never computed
    undecodable = run(slot, path.Ask(Want(), [b"bad"], each=True, expires=time.perf_counter() - 1), "stream")
    assert str(undecodable.errors[0]) == "not an image"  # its error, not its age, decides its fate


def test_output_tensor_raw_and_values_agree() -> None:
    tensor = OutputTensor("LOGITS", "FP32", [2, 3], LOGITS)
    assert np.frombuffer(tensor.raw(), "<f4").tolist() == tensor.values()
