"""A model's named outputs, several of them, of other dtypes and ranks than a classifier's logits, travel whole from
the runtime through the batcher and the shared-memory link: each batch-first, row-aligned with the request's images,
a failed image's rows zero in every one. Built on a two-output ONNX graph made here (no export, no training): boxes
``[N, 12, 4]`` float32 and labels ``[N, 48]`` int64, both the pixels, so each row says whose image it came from."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import numpy as np
import pytest

from service.core.errors import BadInputError
from service.core.settings import ServerSettings
from service.core.spec import InputSpec, ModelSpec
from service.core.status import OutputInfo
from service.engine.batcher import Batcher, BatcherConfig, InferRequest
from service.runtime import FaultInjectingRuntime, OnnxRuntime, TorchScriptRuntime
from tests.transport.test_link_contract import shared_memory_link, submit, until

SPEC = ModelSpec(
    name="pair",
    architecture="pair",
    input=InputSpec(height=4, width=4),
    resize_size=4,
    mean=(0.0, 0.0, 0.0),
    std=(1.0, 1.0, 1.0),
    labels=tuple("abcdefghij"),
)
INFOS = (OutputInfo("boxes", "float32", (12, 4)), OutputInfo("labels", "int64", (48,)))


def two_output_graph(path: Path) -> None:
    """uint8 [N, 3, 4, 4] in; boxes (the pixels as float32 [N, 12, 4]) and labels (as int64 [N, 48]) out."""
    import onnx
    from onnx import TensorProto, helper

    nodes = [
        helper.make_node("Cast", ["images"], ["as_float"], to=TensorProto.FLOAT),
        helper.make_node("Reshape", ["as_float", "boxes_shape"], ["boxes"]),
        helper.make_node("Cast", ["images"], ["as_int"], to=TensorProto.INT64),
        helper.make_node("Reshape", ["as_int", "labels_shape"], ["labels"]),
    ]
    shapes = [
        helper.make_tensor("boxes_shape", TensorProto.INT64, [3], [0, 12, 4]),
        helper.make_tensor("labels_shape", TensorProto.INT64, [2], [0, 48]),
    ]
    graph = helper.make_graph(
        nodes,
        "pair",
        [helper.make_tensor_value_info("images", TensorProto.UINT8, ["N", 3, 4, 4])],
        [
            helper.make_tensor_value_info("boxes", TensorProto.FLOAT, ["N", 12, 4]),
            helper.make_tensor_value_info("labels", TensorProto.INT64, ["N", 48]),
        ],
        initializer=shapes,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


@pytest.fixture
def model_path(tmp_path: Path) -> Path:
    path = tmp_path / "repo" / "pair" / "1" / "model.onnx"
    path.parent.mkdir(parents=True)
    two_output_graph(path)
    (path.parent / "spec.json").write_bytes(msgspec.json.encode(SPEC))
    return path


def images(n: int) -> np.ndarray:
    return (np.arange(n, dtype=np.uint8)[:, None] * 7 + np.arange(48, dtype=np.uint8)).reshape(n, 3, 4, 4)


def expected(batch: np.ndarray) -> dict[str, np.ndarray]:
    n = len(batch)
    return {"boxes": batch.astype(np.float32).reshape(n, 12, 4), "labels": batch.astype(np.int64).reshape(n, 48)}


def test_onnxruntime_learns_each_outputs_name_dtype_and_per_image_shape(model_path: Path) -> None:
    runtime = OnnxRuntime(SPEC, model_path)
    try:
        assert runtime.outputs == INFOS
        batch = images(3)
        got = runtime.submit_outputs(batch).result()
        assert list(got) == ["boxes", "labels"]
        for name, want in expected(batch).items():
            assert got[name].dtype == want.dtype and np.array_equal(got[name], want)
        assert np.array_equal(runtime.run(batch), expected(batch)["boxes"])  # run: the first output alone
    finally:
        runtime.close()


def test_the_batcher_keeps_every_output_row_aligned_and_zeroes_a_failed_images_rows(model_path: Path) -> None:
    batch = images(5)
    poison = 3

    def fault(b: np.ndarray) -> Exception | None:
        return BadInputError("poison") if any(np.array_equal(image, batch[poison]) for image in b) else None

    runtime = FaultInjectingRuntime(OnnxRuntime(SPEC, model_path), fault)

    async def scenario() -> None:
        batcher = Batcher([runtime], BatcherConfig(max_batch_size=8, max_queue_delay_ms=1.0), name="pair")
        try:
            result = await batcher.submit(InferRequest(request_id="r", model="pair", version=1, images=batch))
        finally:
            await batcher.close()
        assert [e is not None for e in result.errors] == [i == poison for i in range(5)]
        want = expected(batch)
        for name, array in result.outputs.items():
            assert array.dtype == want[name].dtype and array.shape == want[name].shape
            for row in range(5):
                assert np.array_equal(array[row], np.zeros_like(array[row]) if row == poison else want[name][row])

    asyncio.run(scenario())


def test_the_shared_memory_link_carries_every_output_back_intact(model_path: Path, tmp_path: Path) -> None:
    settings = ServerSettings(repository=str(model_path.parent.parent.parent), grpc_port=0)

    async def scenario() -> None:
        async with shared_memory_link(settings, tmp_path) as (link, _owner):
            await until(lambda: link.up)
            batch = images(4)
            answer = await submit(link, "pair", batch)
            tensors = {t.name: t for t in answer.result.outputs}
            assert [(t.name, t.dtype, t.shape) for t in answer.result.outputs] == [
                (i.name, i.dtype, i.shape) for i in INFOS
            ]
            for name, want in expected(batch).items():
                got = tensors[name].array(4)  # what the front end rebuilds, over the message's bytes
                assert got.dtype == want.dtype and np.array_equal(got, want)

    asyncio.run(scenario())


def test_a_torchscript_module_answering_a_dict_serves_each_entry_by_name(tmp_path: Path) -> None:
    import torch

    class Pair(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            n = x.shape[0]
            return {"boxes": x.float().reshape(n, 12, 4), "labels": x.long().reshape(n, 48)}

    torch.jit.script(Pair()).save(str(tmp_path / "model.pt"))
    runtime = TorchScriptRuntime(SPEC, tmp_path / "model.pt")
    try:
        assert runtime.outputs == INFOS
        batch = images(2)
        got = runtime.submit_outputs(batch).result()
        for name, want in expected(batch).items():
            assert got[name].dtype == want.dtype and np.array_equal(got[name], want)
    finally:
        runtime.close()
