"""Models from elsewhere: an ONNX or TorchScript file that takes float (normalised) input, placed in the
repository behind a uint8 front, so it is served like one of ours.

An ONNX graph gets new nodes in front of its input (Cast -> Mul -> Add, and a Transpose for NHWC models) and
a symbolic batch dimension. If the graph cannot run batches larger than one (a batch size baked into a Reshape,
say), it is still accepted, and its ``max_batch_size`` is set to 1 in the config written for it.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import msgspec
import numpy as np
import torch
from torch import nn

from export.detect_parity import reference_of
from export.exporter import (
    DEFAULT_FORMATS,
    Candidate,
    ExportReport,
    ExportRequest,
    Int8Source,
    Progress,
    export_source,
    publish,
)
from export.sources import Source, calibration_images
from models.checkpoint import file_sha256
from models.normalize import Uint8Classifier
from service.core.errors import ConfigError
from service.core.layouts import Layout, check_outputs
from service.core.repository import onnx_single_input
from service.core.spec import InputSpec, ModelSpec, Resize
from service.core.tasks import task_named
from service.runtime import load_torchscript

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
UNIT_MEAN, UNIT_STD = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)  # x / 255: what YOLO exports take


def read_labels(path: str | Path) -> tuple[str, ...]:
    """One label per line (blank lines skipped), or a JSON list of strings."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read labels file {path}: {exc.strerror or exc}") from exc
    if text.lstrip().startswith("["):
        try:
            labels = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"labels file {path} looks like JSON but does not parse: {exc}") from exc
        if not isinstance(labels, list) or not all(isinstance(x, str) for x in labels):
            raise ConfigError(f"labels file {path} must hold a JSON list of strings")
    else:
        labels = [line.strip() for line in text.splitlines() if line.strip()]
    if not labels:
        raise ConfigError(f"labels file {path} holds no labels")
    return tuple(labels)


@dataclass(frozen=True)
class InputDescription:
    height: int
    width: int
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    layout: str = "nchw"  # the outside model's float input layout: nchw or nhwc
    resize_size: int | None = None
    task: str = "classify"
    output_layout: Layout | None = None  # a detector's (service/core/layouts.py)
    resize: Resize = "center_crop"
    pad_value: int = 114


def described(args: Any) -> InputDescription:
    """The input description of ``export --onnx/--torchscript``'s arguments: a detector takes x / 255 (mean 0, std
    1) and is letterboxed by default, as YOLO exports are; a classifier ImageNet's normalisation and a centre crop."""
    task = task_named(args.task)
    return InputDescription(
        height=args.input_size[0],
        width=args.input_size[1],
        mean=args.mean or (UNIT_MEAN if task.unit_input else IMAGENET_MEAN),
        std=args.std or (UNIT_STD if task.unit_input else IMAGENET_STD),
        layout=args.layout,
        resize_size=args.resize_size,
        task=args.task,
        output_layout=args.output_layout,
        resize=args.resize or cast(Resize, task.resize),
        pad_value=args.pad_value,
    )


def outside_spec(name: str, kind: str, labels: Sequence[str], desc: InputDescription) -> ModelSpec:
    if desc.layout not in ("nchw", "nhwc"):
        raise ConfigError(f"--layout must be nchw or nhwc, got {desc.layout!r}")
    resize = desc.resize_size or max(desc.height, desc.width, round(max(desc.height, desc.width) / 0.875))
    try:
        return ModelSpec(
            name=name,
            architecture=f"external-{kind}",
            input=InputSpec(channels=3, height=desc.height, width=desc.width),
            resize_size=resize,
            mean=tuple(desc.mean),
            std=tuple(desc.std),
            labels=tuple(labels),
            task=desc.task,
            output_layout=desc.output_layout,
            resize=desc.resize,
            pad_value=desc.pad_value,
        )
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"the input description is inconsistent: {exc}") from exc


def wrap_onnx(src: Path, dst: Path, spec: ModelSpec, layout: str) -> None:
    """Write ``dst``: ``src`` behind a uint8 NCHW input that is normalised inside the graph."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    try:
        model = onnx.load(str(src))
    except Exception as exc:
        raise ConfigError(f"{src} is not a readable ONNX model: {exc}") from exc
    graph = model.graph
    original = onnx_single_input(graph, src)
    elem = original.type.tensor_type.elem_type
    for value in (original, *graph.output):
        dims = value.type.tensor_type.shape.dim
        if dims:
            dims[0].dim_param = "batch"  # setting dim_param clears a fixed dim_value
    del graph.value_info[:]  # stale static shapes would contradict the new batch dimension
    if elem != TensorProto.UINT8:
        if elem not in (TensorProto.FLOAT, TensorProto.FLOAT16):
            raise ConfigError(f"{src} input must be float32, float16 or uint8, is {TensorProto.DataType.Name(elem)}")
        c = spec.input.channels
        mean = np.asarray(spec.mean, np.float32).reshape(1, c, 1, 1)
        std = np.asarray(spec.std, np.float32).reshape(1, c, 1, 1)
        graph.initializer.extend(
            [
                numpy_helper.from_array(1.0 / (255.0 * std), "vs_scale"),
                numpy_helper.from_array(-mean / std, "vs_shift"),
            ]
        )
        last = "vs_normalised"
        nodes = [
            helper.make_node("Cast", ["input"], ["vs_float"], to=TensorProto.FLOAT),
            helper.make_node("Mul", ["vs_float", "vs_scale"], ["vs_scaled"]),
            helper.make_node("Add", ["vs_scaled", "vs_shift"], [last]),
        ]
        if layout == "nhwc":
            nodes.append(helper.make_node("Transpose", [last], ["vs_nhwc"], perm=[0, 2, 3, 1]))
            last = "vs_nhwc"
        if elem == TensorProto.FLOAT16:
            nodes.append(helper.make_node("Cast", [last], ["vs_half"], to=TensorProto.FLOAT16))
            last = "vs_half"
        nodes.append(helper.make_node("Identity", [last], [original.name]))
        new_input = helper.make_tensor_value_info(
            "input", TensorProto.UINT8, ["batch", c, spec.input.height, spec.input.width]
        )
        graph.input.remove(original)
        graph.input.insert(0, new_input)
        for i, node in enumerate(nodes):
            graph.node.insert(i, node)
    try:
        onnx.checker.check_model(model)
    except Exception as exc:
        raise ConfigError(f"the wrapped graph of {src} does not pass onnx.checker: {exc}") from exc
    onnx.save(model, str(dst))


class _Nhwc(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x.permute(0, 2, 3, 1))


def torchscript_reference(src: Path, layout: str) -> nn.Module:
    """The outside TorchScript module, taking normalised float NCHW (a permute in front for NHWC models)."""
    try:
        module = load_torchscript(src, "cpu").eval()
    except Exception as exc:
        raise ConfigError(f"{src} is not a loadable TorchScript file: {exc}") from exc
    return _Nhwc(module) if layout == "nhwc" else module


class OnnxReference:
    """Runs the outside ONNX model on float input normalised in numpy: the parity reference for its wrapper."""

    def __init__(self, src: Path, spec: ModelSpec, layout: str) -> None:
        import onnxruntime as ort

        try:
            self.session = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
        except Exception as exc:
            raise ConfigError(f"onnxruntime cannot load {src}: {exc}") from exc
        meta = self.session.get_inputs()
        self.name = meta[0].name
        self.dtype = np.float16 if meta[0].type == "tensor(float16)" else np.float32
        self.uint8 = meta[0].type == "tensor(uint8)"
        c = spec.input.channels
        self.mean = np.asarray(spec.mean, np.float32).reshape(1, c, 1, 1)
        self.std = np.asarray(spec.std, np.float32).reshape(1, c, 1, 1)
        self.layout = layout
        self.one_at_a_time = meta[0].shape[:1] == [1]  # a graph with a fixed batch of one

    def outputs(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        """Every output by name, batch-first."""
        if self.one_at_a_time and len(batch) > 1:
            each = [self.outputs(batch[i : i + 1]) for i in range(len(batch))]
            return {name: np.concatenate([one[name] for one in each]) for name in each[0]}
        if self.uint8:
            x: np.ndarray = batch
        else:
            x = ((batch.astype(np.float32) / 255.0 - self.mean) / self.std).astype(self.dtype)
            if self.layout == "nhwc":
                x = x.transpose(0, 2, 3, 1)
        names = [o.name for o in self.session.get_outputs()]
        return dict(zip(names, self.session.run(None, {self.name: np.ascontiguousarray(x)}), strict=True))


def runs_batches(session_run: OnnxReference, spec: ModelSpec) -> bool:
    """Whether the wrapped model accepts a batch of two (graphs with a baked-in batch of one do not)."""
    batch = np.zeros((2, spec.input.channels, spec.input.height, spec.input.width), np.uint8)
    with contextlib.suppress(Exception), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return next(iter(session_run.outputs(batch).values())).shape[0] == 2
    return False


def _check_width(out: np.ndarray, labels: Sequence[str], src: Path) -> None:
    if out.ndim != 2 or out.shape[1] != len(labels):
        raise ConfigError(
            f"{src} outputs shape {list(out.shape)} for one image, but the labels file has {len(labels)} labels: "
            "expected [1, number of labels]"
        )


def _probe_onnx(wrapped: Path, src: Path, spec: ModelSpec, labels: Sequence[str], layout: str) -> list[str]:
    """Refuse a wrapped graph that does not run on the described input or gives other than one output per label;
    the report's notes (a batch of one fixed inside the graph, served unbatched)."""
    probe = OnnxReference(wrapped, spec, layout)
    try:
        outputs = probe.outputs(np.zeros((1, 3, spec.input.height, spec.input.width), np.uint8))
    except Exception as exc:
        raise ConfigError(f"{src} does not run on a batch of the described input: {exc}") from exc
    if spec.output_layout is not None:  # a detector: its real output shapes held to its layout
        check_outputs(spec.output_layout, {k: list(v.shape) for k, v in outputs.items()}, len(labels))
    else:
        _check_width(np.asarray(next(iter(outputs.values()))), labels, src)
    if runs_batches(probe, spec):
        return []
    return [
        f"{src.name} has a batch size of 1 fixed inside its graph: it is served with max_batch_size = 1 "
        "(re-export it with a dynamic batch dimension to batch)"
    ]


def place_outside_model(
    *,
    onnx_path: str | None,
    torchscript_path: str | None,
    request: ExportRequest,
    labels: Sequence[str],
    description: InputDescription,
    calibration: str | None = None,
    progress: Progress | None = None,
    int8_data: Int8Source | None = None,
) -> ExportReport:
    """Wrap an outside ONNX or TorchScript model for uint8 input, check it runs, prove parity, and publish it."""
    say = progress or (lambda _msg: None)
    kind = "onnx" if onnx_path else "torchscript"
    src = Path(onnx_path or torchscript_path or "")
    if not src.is_file():
        raise ConfigError(f"--{kind} {src} does not exist")
    spec = outside_spec(request.name, kind, labels, description)
    images, real_source = None, "random uint8 batches only"
    if calibration:
        images = calibration_images(calibration, spec)
        real_source = f"{len(images)} images from {calibration} and random uint8 batches"
    sha = file_sha256(src)
    if kind == "onnx":
        if "torchscript" in request.formats and request.formats != DEFAULT_FORMATS:
            raise ConfigError("an ONNX model goes into the repository as ONNX: use --formats onnx")
        request = msgspec.structs.replace(request, formats=("onnx",), fp16=False)
        with tempfile.TemporaryDirectory() as tmp:
            wrapped = Path(tmp) / "model.onnx"
            wrap_onnx(src, wrapped, spec, description.layout)
            notes = _probe_onnx(wrapped, src, spec, labels, description.layout)
            if notes:
                say(notes[-1])
                request = msgspec.structs.replace(request, max_batch_size=1)
            original = OnnxReference(src, spec, description.layout)

            def produce(path: Path) -> None:
                shutil.copyfile(wrapped, path)

            candidate = Candidate("onnx", "fp32", produce)
            return publish(
                spec,
                request,
                [candidate],
                lambda batches: [reference_of(spec, original.outputs(b)) for b in batches],
                real_images=images,
                real_source=real_source,
                source_sha256=sha,
                progress=progress,
                notes=notes,
                int8_data=int8_data,
            )
    if task_named(spec.task).layouts:
        raise ConfigError(
            "an outside detector is placed from ONNX (--onnx): its outputs are checked against --output-layout by "
            "name and shape there; export it to ONNX first (ultralytics: yolo export model=M.pt format=onnx)"
        )
    if "onnx" in request.formats and request.formats != DEFAULT_FORMATS:
        raise ConfigError("a TorchScript model goes into the repository as TorchScript: use --formats torchscript")
    request = msgspec.structs.replace(request, formats=("torchscript",))
    eager = Uint8Classifier(torchscript_reference(src, description.layout), spec.mean, spec.std).eval()
    try:
        with torch.inference_mode():
            first = eager(torch.zeros((1, 3, spec.input.height, spec.input.width), dtype=torch.uint8)).numpy()
    except Exception as exc:
        raise ConfigError(f"{src} does not run on a batch of the described input: {exc}") from exc
    _check_width(first, labels, src)
    source = Source(eager, spec, sha, images, real_source)
    return export_source(source, request, progress=progress, int8_data=int8_data)
