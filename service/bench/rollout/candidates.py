"""Candidate versions derived from a served ONNX version folder, each disagreeing with it by a known amount, and the
held-out digits that measure it.

A derived version is the source folder copied (``model.onnx``, ``spec.json`` and whatever else it holds), with one
node appended to every ONNX artifact's logits output (``model.onnx``, and ``model.fp16.onnx`` / ``model.int8.onnx``
where present, so a precision setting cannot serve an unchanged file): a ``Gather`` on the class axis
(:func:`permute_labels`) or an ``Add`` of a constant to one class's logit (:func:`bias_logits`). The TorchScript and
AOTInductor artifacts cannot be edited that way, so a derived version drops them and their records in ``spec.json``:
whatever runtime the server picks, it serves the derived graph.

Agreement is top-1 agreement, as the server's rollout comparison counts it (docs/rollouts.md). Every figure here
comes from onnxruntime on the CPU over uint8 ``[N, C, H, W]`` images made by the server's own preprocessing.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from service.bench.kit import ROOT
from service.core.repository import FP16_FILES, INT8_FILES, MODEL_FILES
from service.core.spec import load_spec, write_spec

DIGITS_VERSION = ROOT / "examples" / "model_repository" / "digits" / "1"
SPEC_FILE = "spec.json"
ONNX_FILES = tuple(
    name for table in (MODEL_FILES, FP16_FILES, INT8_FILES) for fmt, name in table.items() if fmt == "onnx"
)
OTHER_FILES = tuple(name for table in (MODEL_FILES, FP16_FILES) for fmt, name in table.items() if fmt != "onnx")
BATCH = 64  # images per onnxruntime run


def copy_version(src_dir: str | Path, dst_dir: str | Path) -> Path:
    """``src_dir`` copied file for file to ``dst_dir`` (which must not exist): a candidate that agrees on every
    image. Returns ``dst_dir``."""
    dst = Path(dst_dir)
    shutil.copytree(src_dir, dst)
    return dst


def permute_labels(src_dir: str | Path, dst_dir: str | Path, seed: int = 0) -> list[int]:
    """A version whose logits are the source's with the classes shuffled by a seeded random derangement
    (``candidate[:, j] = source[:, perm[j]]``, ``perm[j] != j`` for every ``j``), so its top-1 differs from the
    source's on every image without a tied maximum. Returns ``perm``."""
    classes = load_spec(Path(src_dir) / SPEC_FILE).num_classes
    if classes < 2:
        raise ValueError(f"a derangement needs at least 2 classes, the model has {classes}")
    rng = np.random.default_rng(seed)
    while True:  # rejection: a uniform derangement in about e tries
        perm = rng.permutation(classes)
        if not np.any(perm == np.arange(classes)):
            break
    _derive(src_dir, dst_dir, lambda model: _gather_classes(model, perm))
    return [int(p) for p in perm]


def bias_logits(src_dir: str | Path, dst_dir: str | Path, class_index: int, bias: float) -> Path:
    """A version whose logit of class ``class_index`` is the source's plus ``bias`` (the others unchanged): with a
    positive bias, the images whose top-1 margin over that class is below ``bias`` change their answer to it.
    Returns ``dst_dir``."""
    classes = load_spec(Path(src_dir) / SPEC_FILE).num_classes
    if not 0 <= class_index < classes:
        raise ValueError(f"class_index must be in 0..{classes - 1}, got {class_index}")
    _derive(src_dir, dst_dir, lambda model: _add_to_class(model, class_index, bias, classes))
    return Path(dst_dir)


def calibrate_disagreement(
    src_dir: str | Path, images_uint8: np.ndarray, target_fraction: float
) -> tuple[int, float, float]:
    """The class and bias for :func:`bias_logits` whose candidate disagrees with the source's top-1 on about
    ``target_fraction`` of ``images_uint8`` ([N, C, H, W] uint8), and the fraction measured on a candidate built
    with them and run by onnxruntime: ``(class_index, bias, measured_fraction)``.

    The images that change answer under a bias ``b`` on class ``c`` are those whose top-1 is not ``c`` and whose
    margin (their top logit minus their logit of ``c``) is below ``b``: the count is a step function of ``b`` whose
    steps are the sorted margins, read off the source's logits (one onnxruntime pass) rather than bisected run by
    run. The bias flips the ``round(target_fraction * N)`` smallest margins and sits midway between the last one it
    flips and the first it keeps, so that the small differences between one batch composition and another
    (onnxruntime's kernels by batch size) cannot move an image across it; of the classes, the one with the widest
    such gap is taken."""
    if not 0 <= target_fraction < 1:
        raise ValueError(f"target_fraction must be in [0, 1), got {target_fraction}")
    source = Path(src_dir)
    primary = logits(source, images_uint8)
    count = len(primary)
    want = round(target_fraction * count)
    top, best = primary.argmax(axis=1), primary.max(axis=1)
    chosen: tuple[float, int, float] | None = None  # (gap, class, bias)
    for c in range(primary.shape[1]):
        margins = np.sort((best - primary[:, c])[top != c])
        if len(margins) < want:
            continue
        bias = _centred_bias(margins, want)
        gap = 2 * (bias - (float(margins[want - 1]) if want > 0 else 0.0))
        if chosen is None or gap > chosen[0]:
            chosen = (gap, c, bias)
    if chosen is None:
        raise ValueError(f"no class can be moved onto {want} of {count} images")
    _, class_index, bias = chosen
    with tempfile.TemporaryDirectory(prefix="vs-calibrate-") as tmp:
        candidate = bias_logits(source, Path(tmp) / "candidate", class_index, bias)
        return class_index, bias, float(np.mean(top1(candidate, images_uint8) != top))


def _centred_bias(margins: np.ndarray, want: int) -> float:
    """The bias that flips exactly the ``want`` smallest of these sorted ``margins``, midway in its step."""
    if want == 0:
        return float(margins[0]) / 2 if len(margins) else 0.0
    flipped = float(margins[want - 1])
    kept = float(margins[want]) if want < len(margins) else flipped + 1.0
    return (flipped + kept) / 2


def _derive(src_dir: str | Path, dst_dir: str | Path, edit: Callable[[Any], None]) -> None:
    """``src_dir`` copied to ``dst_dir`` with ``edit`` applied to every ONNX artifact, the others dropped."""
    import onnx

    dst = copy_version(src_dir, dst_dir)
    for name in OTHER_FILES:
        (dst / name).unlink(missing_ok=True)
    spec = load_spec(dst / SPEC_FILE)
    kept = tuple(e for e in spec.exports if e.format == "onnx")
    if kept != spec.exports:
        import msgspec

        write_spec(msgspec.structs.replace(spec, exports=kept), dst / SPEC_FILE)
    for name in ONNX_FILES:
        path = dst / name
        if not path.is_file():
            continue
        model = onnx.load(str(path), load_external_data=False)  # external weights, if any, were copied beside it
        edit(model)
        onnx.save(model, str(path))
        onnx.checker.check_model(str(path))


def _append(model: Any, op: str, constant: np.ndarray, constant_name: str, node_name: str, **attrs: Any) -> None:
    """The graph's first output (the logits) detached from the node that makes it and made instead by ``op`` of
    what that node makes and ``constant`` (an initializer named ``OUTPUT__constant_name``)."""
    from onnx import helper, numpy_helper

    graph = model.graph
    out = graph.output[0].name
    inner, constant_name = f"{out}__before_candidate", f"{out}__{constant_name}"
    for node in graph.node:
        for field in (node.output, node.input):
            for i, name in enumerate(field):
                if name == out:
                    field[i] = inner
    graph.initializer.append(numpy_helper.from_array(constant, constant_name))
    graph.node.append(helper.make_node(op, [inner, constant_name], [out], name=node_name, **attrs))


def _gather_classes(model: Any, perm: np.ndarray) -> None:
    _append(model, "Gather", perm.astype(np.int64), "class_permutation", "candidate_permute", axis=1)


def _add_to_class(model: Any, class_index: int, bias: float, classes: int) -> None:
    from onnx import helper

    offsets = np.zeros(classes, dtype=helper.tensor_dtype_to_np_dtype(model.graph.output[0].type.tensor_type.elem_type))
    offsets[class_index] = bias
    _append(model, "Add", offsets, "class_bias", "candidate_bias")


def logits(version_dir: str | Path, images_uint8: np.ndarray, batch: int = BATCH) -> np.ndarray:
    """The version's ``model.onnx`` run by onnxruntime on the CPU over ``images_uint8``, ``batch`` images a run (a
    model with a fixed batch size: its own): float32 ``[N, classes]``."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(Path(version_dir) / "model.onnx"), options, providers=["CPUExecutionProvider"])
    first = session.get_inputs()[0]
    batch = first.shape[0] if isinstance(first.shape[0], int) else batch
    parts = [
        session.run(None, {first.name: np.ascontiguousarray(images_uint8[i : i + batch])})[0]
        for i in range(0, len(images_uint8), batch)
    ]
    return np.concatenate(parts).astype(np.float32)


def top1(version_dir: str | Path, images_uint8: np.ndarray, batch: int = BATCH) -> np.ndarray:
    """Each image's top-1 class by the version's ``model.onnx``: int ``[N]``."""
    return logits(version_dir, images_uint8, batch).argmax(axis=1)


def agreement(primary_dir: str | Path, candidate_dir: str | Path, images_uint8: np.ndarray) -> float:
    """The share of ``images_uint8`` on which the two versions' top-1 classes agree."""
    return float(np.mean(top1(primary_dir, images_uint8) == top1(candidate_dir, images_uint8)))


@dataclass(frozen=True)
class Digits:
    """scikit-learn's digits as a client sends them (8x8 grayscale PNGs) and as the server's preprocessing makes
    them for a model (uint8 ``[N, C, H, W]``), with their true classes. The first ``held_out`` are the validation
    split the shipped model was not trained on; past it, training images follow (then the whole set again)."""

    pngs: list[bytes]
    images: np.ndarray
    targets: np.ndarray
    held_out: int


def held_out_digits(n: int, version_dir: str | Path = DIGITS_VERSION) -> Digits:
    """``n`` digits, the held-out (validation) ones first, preprocessed for ``version_dir``'s spec by the server's
    own decoding (:func:`service.core.preprocess.preprocess_image` on the PNG bytes)."""
    import io

    from PIL import Image
    from sklearn.datasets import load_digits

    from models.datasets import _split  # the split training used, not a copy of it
    from service.core.preprocess import preprocess_image

    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    spec = load_spec(Path(version_dir) / SPEC_FILE)
    raw = load_digits()
    pixels = np.rint(raw.images * (255.0 / 16.0)).astype(np.uint8)  # as models.datasets scales them for training
    train, val = _split(raw.target, 10)
    order = np.concatenate([val, train])
    order = np.resize(order, n)  # cycles through the set again past its end
    pngs = []
    for i in order:
        buffer = io.BytesIO()
        Image.fromarray(pixels[i]).save(buffer, format="PNG")
        pngs.append(buffer.getvalue())
    images = np.stack([preprocess_image(png, spec) for png in pngs])
    return Digits(pngs=pngs, images=images, targets=raw.target[order].astype(np.int64), held_out=min(n, len(val)))
