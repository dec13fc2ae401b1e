"""``visionserve bench`` on a detector: the detection pipeline in process, and what the server's suppression costs.

For a model whose spec says ``task = "detect"`` the pipeline figure is the whole detection path without HTTP:
decode and letterbox in the decoding pool (each image's transform kept), stack, run, then per image
:func:`~service.core.boxes.suppress` and :func:`~service.core.boxes.to_original` with the spec's defaults (what
the server does for each answer). Beside ``pipeline_images_per_s`` it reports the forward pass and the
suppression and mapping per image, and their ratio (``postprocess_share``): wall time in the pipeline, where the
decoding threads of the next batch contend for the GIL, and its own CPU time (``postprocess_cpu_share``, the
thread's CPU seconds: its cost; measured 2026-11-27 at 1,000 candidates, 0.1 ms wall against 0.04 ms CPU).

The target "suppression and mapping at most 5% of compute per image at 1,000 candidates before suppression"
(issue 44) needs a graph that emits 1,000 candidates: :func:`thousand` copies the served ONNX graph with its TopK's
K raised to 1,000 (the same weights and ops; only how many peaks leave the graph changes), runs the same pipeline
on it, and times the suppression of synthetic dense candidates too (:func:`dense_candidates`: every one of the
1,000 clustered on a few objects, scores spread over the whole range, several classes), against the same forward
pass. Images default to canvases of held-out digits at known boxes (:func:`canvas_corpus`), upscaled so that
decoding and letterboxing do real work.
"""

from __future__ import annotations

import dataclasses
import io
import tempfile
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from PIL import Image

from loadtest.answers import Known
from service.bench.pipeline import Pipeline, timed
from service.core.boxes import Transform, suppress, to_original
from service.core.config import ModelConfig
from service.core.decoding import Preprocessor
from service.core.errors import VisionServeError
from service.core.layouts import image_rows, keep
from service.core.repository import ModelVersion
from service.core.spec import InputSpec, ModelSpec
from service.core.status import InferResult
from service.core.tasks import Detect, DetectOptions, Want, task_for
from service.runtime import RuntimeLike, choose_backend, make_runtime, warm_up

THOUSAND = 1000


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Encoded images, their names and the boxes known in each (empty where unknown)."""

    names: list[str]
    images: list[bytes]
    known: dict[str, list[Known]]


def canvas_corpus(count: int = 32, scale: int = 4, seed: int = 7, quality: int = 90) -> Corpus:
    """``count`` canvases of held-out digits (models/canvases.py: digits training never saw), each upscaled
    ``scale`` times (bilinear) and encoded as JPEG, with their digits' boxes scaled alike."""
    from models.canvases import CanvasParams, digit_pool, make_canvases

    canvases = make_canvases(CanvasParams(), count, pool=digit_pool("heldout"), seed=seed)
    names, images, known = [], [], {}
    for i in range(len(canvases)):
        img = Image.fromarray(canvases.images[i]).convert("RGB")
        img = img.resize((img.width * scale, img.height * scale), Image.Resampling.BILINEAR)
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=quality)
        name = f"canvas-{i:03d}.jpg"
        boxes, labels = canvases.objects(i)
        names.append(name)
        images.append(buf.getvalue())
        known[name] = [_known(b, int(k), scale) for b, k in zip(boxes, labels, strict=True)]
    return Corpus(names, images, known)


def _known(box: np.ndarray, label: int | str, scale: int) -> Known:
    x1, y1, x2, y2 = (float(v) * scale for v in box)
    return Known((x1, y1, x2, y2), str(label))


def default_images() -> tuple[list[bytes], str]:
    """The detection bench's images when none are given, and their description: canvases where the training
    extra (torch, scikit-learn) is installed, else the classifiers' photo-like JPEGs (few boxes in them)."""
    try:
        corpus = canvas_corpus()
    except ImportError:
        from service.core.samples import photo_like_jpegs

        return photo_like_jpegs(), "64 generated 500x375 JPEGs (no training extra: no digit canvases)"
    return corpus.images, f"{len(corpus.images)} canvases of held-out digits, 384x384 JPEGs"


def in_process_answers(
    repository: str | Path, model: str, names: list[str], images: list[bytes]
) -> dict[str, list[Known]]:
    """What the in-process pipeline answers for each image (the latest version, on the CPU, the spec's default
    thresholds): a reference the served answers must match (:mod:`loadtest.answers`)."""
    from service.core.repository import ModelRepository

    entry = ModelRepository(repository).model(model)
    version, spec = entry.latest, entry.latest.spec
    config = msgspec.structs.replace(entry.config, device="cpu")
    runtime = make_runtime(version, config, choose_backend(version, config, "cpu"), "cpu")
    task, out = Detect(spec), dict[str, list[Known]]()
    with closing(runtime), closing(Preprocessor(spec)) as pool:
        for name, data in zip(names, images, strict=True):
            decoding = pool.submit(data)
            pixels = decoding.result()
            assert decoding.transform is not None
            outputs = runtime.submit_outputs(pixels[np.newaxis]).result()
            kept = task.kept(InferResult(outputs, [None]), task.default, [decoding.transform])[0]
            out[name] = [_known(row[:4], spec.labels[int(row[5])], 1) for row in kept]
    return out


class DetectPipeline(Pipeline):
    """The in-process detection path: decoding the next batch (in the pool, transforms kept) overlaps running and
    post-processing the current one. Counts the seconds spent in the forward pass and in suppression and mapping."""

    def __init__(self, jpegs: list[bytes], size: int, runtime: RuntimeLike, pool: Preprocessor) -> None:
        self.pool, self.options = pool, DetectOptions(max_detections=runtime.spec.max_detections)
        self.task = task_for(runtime.spec)
        self.images = self.kept = self.candidates = self.above = 0
        self.compute_s = self.post_s = self.post_cpu_s = self.answer_s = 0.0
        super().__init__(jpegs, size, runtime, self._decode)

    def _decode(self, chunk: list[bytes]) -> tuple[np.ndarray, list[Transform]]:
        arrays, transforms = [], []
        for future in [self.pool.submit(data) for data in chunk]:
            try:
                arrays.append(future.result())
            except VisionServeError:
                continue
            assert future.transform is not None
            transforms.append(future.transform)
        return np.stack(arrays), transforms

    def __call__(self) -> int:
        batch, transforms = self.batch()
        started = time.perf_counter()
        outputs = self.runtime.submit_outputs(batch).result()
        ran, ran_cpu = time.perf_counter(), time.thread_time()
        spec, options = self.runtime.spec, self.options
        rows = image_rows(spec.output_layout, outputs, len(spec.labels))  # every layout read as the server reads it
        kept = [to_original(keep(spec.output_layout, r, options), t) for r, t in zip(rows, transforms, strict=True)]
        self.post_s += time.perf_counter() - ran
        self.post_cpu_s += time.thread_time() - ran_cpu  # its own cost: not the GIL waits beside decoding threads
        # The server's whole answer as the image API builds it: the task's postprocess (suppression, mapping, a
        # segmenter's masks in the image's pixels as RLE) and the answer's rows.
        answered = time.perf_counter()
        self.task.postprocess(InferResult(outputs, [None] * len(batch)), Want(), transforms)
        self.answer_s += time.perf_counter() - answered
        self.compute_s += ran - started
        self.images += len(batch)
        self.kept += sum(len(k) for k in kept)
        self.candidates += sum(len(r) for r in rows)
        self.above += sum(int((r[:, 4] >= options.score_threshold).sum()) for r in rows)
        return len(batch)

    def figures(self, rate: float) -> dict[str, Any]:
        """The pipeline's images/s (``rate``), and per image: forward and post-processing ms, their ratio,
        candidates from the graph, those above the score threshold and detections kept."""
        n, compute_s = max(self.images, 1), self.compute_s or float("nan")
        return {
            "pipeline_images_per_s": rate,
            "compute_ms_per_image": 1000 * self.compute_s / n,
            "postprocess_ms_per_image": 1000 * self.post_s / n,
            "postprocess_share": self.post_s / compute_s,
            "postprocess_cpu_ms_per_image": 1000 * self.post_cpu_s / n,
            "postprocess_cpu_share": self.post_cpu_s / compute_s,
            "candidates_per_image": self.candidates / n,
            "above_threshold_per_image": self.above / n,
            "detections_per_image": self.kept / n,
            "answer_ms_per_image": 1000 * self.answer_s / n,
            "answer_share": self.answer_s / compute_s,
        }


def pipeline_figures(
    jpegs: list[bytes], size: int, runtime: RuntimeLike, pool: Preprocessor, seconds: float
) -> dict[str, Any]:
    """:class:`DetectPipeline`'s figures over ``seconds`` at batch ``size``."""
    with closing(DetectPipeline(jpegs, size, runtime, pool)) as step:
        return step.figures(timed(seconds, step))


def thousand_graph(onnx_path: Path, out: Path, k: int = THOUSAND) -> Path:
    """A copy of a ``candidates`` graph at ``onnx_path`` whose TopK keeps ``k`` candidates, written to ``out``;
    ValueError when the graph's K is not one constant (then it cannot be raised here)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(onnx_path))
    tops = [n for n in model.graph.node if n.op_type == "TopK"]
    constants = {i.name: i for i in model.graph.initializer}
    if len(tops) != 1 or tops[0].input[1] not in constants:
        raise ValueError(f"{onnx_path}: expected one TopK with a constant K, found {len(tops)} TopK")
    constants[tops[0].input[1]].CopyFrom(numpy_helper.from_array(np.array([k], np.int64), tops[0].input[1]))
    del model.graph.value_info[:]  # shapes recorded for K=100; onnxruntime infers them again
    for output in model.graph.output:
        dims = output.type.tensor_type.shape.dim
        if len(dims) == 3:
            dims[1].dim_value = k
    onnx.save(model, str(out))
    return out


def dense_candidates(rng: np.random.Generator, size: int, classes: int, k: int = THOUSAND) -> np.ndarray:
    """``[k, 6]`` candidates as a dense (YOLO-style) head emits them before suppression, in input pixels of a
    ``size`` square: 2-6 objects, a quarter of the candidates clustered on them (jittered boxes, IoU with their
    object mostly 0.3-0.9, scores spread over 0.2-0.95, a fifth of them another class than the object's), the rest
    anywhere with low scores (Beta(1, 20): a few above 0.25). Some 250 pass the default threshold: tens of times
    what the trained digits head leaves."""
    objects = int(rng.integers(2, 7))
    centre = rng.uniform(0.15 * size, 0.85 * size, (objects, 2))
    extent = rng.uniform(0.1 * size, 0.4 * size, (objects, 2))
    label = rng.integers(0, classes, objects)
    near = k // 4
    which = rng.integers(0, objects, near)
    xy = np.concatenate([centre[which] + rng.normal(0, 0.1, (near, 2)) * extent[which],
                         rng.uniform(0, size, (k - near, 2))])  # fmt: skip
    wh = np.concatenate(
        [extent[which] * rng.uniform(0.7, 1.3, (near, 2)), rng.uniform(0.05, 0.4, (k - near, 2)) * size]
    )
    cls = rng.integers(0, classes, k)
    cls[:near] = np.where(rng.uniform(size=near) < 0.8, label[which], cls[:near])
    score = np.concatenate([rng.uniform(0.2, 0.95, near), rng.beta(1, 20, k - near)])
    rows = np.concatenate([xy - wh / 2, xy + wh / 2, score[:, None], cls[:, None]], axis=1)
    rows[:, :4] = np.clip(rows[:, :4], 0, size)
    return rows[rng.permutation(k)].astype(np.float32)


def yolo_head(seed: int = 0, objects: int = 60, anchors: int = 8400, classes: int = 80) -> np.ndarray:
    """A YOLOv8-like raw output ``[1, 4 + classes, anchors]`` for a 640 input (output_layout ``yolo``):
    ``objects`` objects, each seen by many anchors (jittered boxes, scores 0.2-0.95), the rest background scoring
    low on a few classes; some 1,500 anchors above 0.25."""
    rng = np.random.default_rng(seed)
    out = np.zeros((4 + classes, anchors), dtype=np.float32)
    centre = rng.uniform(20, 620, (anchors, 2))
    size = rng.uniform(8, 120, (anchors, 2))
    scores = rng.uniform(0, 0.2, (anchors, classes)).astype(np.float32) * (rng.random((anchors, classes)) < 0.05)
    owner = rng.integers(0, objects, anchors)
    seen = rng.random(anchors) < 0.2  # a fifth of the anchors sit on an object
    obj_centre = rng.uniform(40, 600, (objects, 2))
    obj_size = rng.uniform(16, 200, (objects, 2))
    obj_class = rng.integers(0, classes, objects)
    centre[seen] = obj_centre[owner[seen]] + rng.normal(0, 4, (seen.sum(), 2))
    size[seen] = obj_size[owner[seen]] * rng.uniform(0.8, 1.2, (seen.sum(), 2))
    scores[seen, obj_class[owner[seen]]] = rng.uniform(0.2, 0.95, seen.sum())
    out[:2], out[2:4], out[4:] = centre.T, size.T, scores.T
    return out[None]


def seconds_each(items: list[Any], work: Callable[[Any], object], seconds: float, at_least: int) -> float:
    """Seconds per item of ``work`` on ``items`` in turns, over ``seconds`` and at least ``at_least`` items."""
    done, started = 0, time.perf_counter()
    while done < at_least or time.perf_counter() - started < seconds:
        work(items[done % len(items)])
        done += 1
    return (time.perf_counter() - started) / done


def time_yolo(seconds: float, heads: int = 4) -> dict[str, float]:
    """The server's decode and suppression of :func:`yolo_head` outputs (layouts.image_rows, then suppress with
    the defaults and ultralytics' max_det 300), per image, in turns over ``heads`` seeds."""
    options = DetectOptions(max_detections=300)
    outputs = [{"output0": yolo_head(seed)} for seed in range(heads)]
    above = float(np.mean([len(image_rows("yolo", o, 80, options.score_threshold)[0]) for o in outputs]))
    each_s = seconds_each(
        outputs, lambda o: suppress(image_rows("yolo", o, 80, options.score_threshold)[0], options), seconds, 4 * heads
    )
    return {"decode_suppress_ms_per_image": 1000 * each_s, "above_threshold": above}


def yolo_seg_head(seed: int = 0, objects: int = 30, anchors: int = 8400, classes: int = 80) -> dict[str, np.ndarray]:
    """A YOLOv8-seg-like answer for a 640 input: ``output0`` ``[1, 4 + classes + 32, anchors]`` and the prototypes
    ``output1`` ``[1, 32, 160, 160]``; ``objects`` apart on a grid, each seen by some anchors (jittered boxes,
    scores 0.3-0.95), the rest background under 0.2; each mask an ellipse in its box (prototype k is object k's,
    its anchors' coefficients pick it)."""
    rng = np.random.default_rng(seed)
    cells = np.array([(c, r) for r in range(6) for c in range(6)][:objects], dtype=np.float32)
    centre = 53 + 106 * cells + rng.normal(0, 4, (objects, 2))
    size = rng.uniform(50, 95, (objects, 2))
    out = np.zeros((4 + classes + 32, anchors), dtype=np.float32)
    owner, seen = rng.integers(0, objects, anchors), rng.random(anchors) < 0.2
    out[:2] = np.where(seen, (centre[owner] + rng.normal(0, 1.5, (anchors, 2))).T, rng.uniform(20, 620, (2, anchors)))
    out[2:4] = np.where(
        seen, (size[owner] * rng.uniform(0.95, 1.05, (anchors, 2))).T, rng.uniform(8, 120, (2, anchors))
    )
    out[4 : 4 + classes] = rng.uniform(0, 0.2, (classes, anchors))
    out[4 + rng.integers(0, classes, objects)[owner[seen]], np.flatnonzero(seen)] = rng.uniform(0.3, 0.95, seen.sum())
    out[4 + classes + owner[seen], np.flatnonzero(seen)] = 1.0
    grid = (np.arange(160) + 0.5) * 4  # the prototypes' cell centres, in input pixels
    dx = (grid[None, None, :] - centre[:, 0, None, None]) / (size[:, 0, None, None] / 2)
    dy = (grid[None, :, None] - centre[:, 1, None, None]) / (size[:, 1, None, None] / 2)
    protos = np.full((32, 160, 160), -4.0, dtype=np.float32)
    protos[:objects] = 4 * (1 - dx**2 - dy**2)
    return {"output0": out[None], "output1": protos[None]}


def time_yolo_seg(seconds: float, heads: int = 4) -> dict[str, float]:
    """The server's answer to :func:`yolo_seg_head` outputs for 640 x 640 images (suppression, each instance's mask
    in the image's pixels as RLE, the rows), per image, in turns over ``heads`` seeds; and the answer's JSON size."""
    spec = ModelSpec(name="yolo-seg", architecture="yolo-seg", input=InputSpec(channels=3, height=640, width=640),
                     resize_size=640, mean=(0.0,) * 3, std=(1.0,) * 3, labels=tuple(map(str, range(80))),
                     task="segment", output_layout="yolo-seg", resize="letterbox")  # fmt: skip
    task, where = task_for(spec), [Transform(640, 640)]
    outputs = [InferResult(yolo_seg_head(seed), [None]) for seed in range(heads)]
    answers = [task.postprocess(o, Want(), where).predictions[0] for o in outputs]
    each_s = seconds_each(outputs, lambda o: task.postprocess(o, Want(), where), seconds, 4 * heads)
    return {
        "answer_ms_per_image": 1000 * each_s,
        "instances_per_image": float(np.mean([len(a) for a in answers])),
        "answer_kb_per_image": float(np.mean([len(msgspec.json.encode(a)) for a in answers])) / 1000,
    }


def thousand(
    version: ModelVersion,
    config: ModelConfig,
    device: str,
    jpegs: list[bytes],
    size: int,
    pool: Preprocessor,
    seconds: float,
) -> dict[str, Any]:
    """The suppression target's figures at 1,000 candidates an image (see the module docstring), or the reason
    they could not be measured (``skipped``)."""
    spec: ModelSpec = version.spec
    if spec.output_layout != "candidates" or "onnx" not in version.files:
        return {"skipped": "needs an ONNX graph with output_layout candidates"}
    with tempfile.TemporaryDirectory(prefix="vs-bench-detect-") as scratch:
        try:
            path = thousand_graph(version.files["onnx"], Path(scratch) / "model.onnx")
        except ValueError as exc:
            return {"skipped": str(exc)}
        wider = dataclasses.replace(version, path=Path(scratch), files={"onnx": path}, fp16_files={}, int8_files={})
        chosen = msgspec.structs.replace(config, backend="onnxruntime", precision="fp32")
        with closing(make_runtime(wider, chosen, "onnxruntime", device, cuda_graphs=False)) as runtime:
            warm_up(runtime, size)
            measured = pipeline_figures(jpegs, size, runtime, pool, seconds)
    forward_s = measured["compute_ms_per_image"] / 1000
    options = DetectOptions(max_detections=spec.max_detections)
    rng = np.random.default_rng(0)
    dense = [dense_candidates(rng, spec.input.width, len(spec.labels)) for _ in range(64)]
    where = Transform(spec.input.width * 4, spec.input.height * 4, 0.25, 0.25)
    dense_s = seconds_each(dense, lambda rows: to_original(suppress(rows, options), where), seconds / 2, len(dense))
    above = float(np.mean([(d[:, 4] >= options.score_threshold).sum() for d in dense]))
    model = ("postprocess_ms_per_image", "postprocess_share", "postprocess_cpu_ms_per_image", "postprocess_cpu_share",
             "above_threshold_per_image", "detections_per_image")  # fmt: skip
    return {
        "candidates_per_image": measured["candidates_per_image"],
        "compute_ms_per_image": measured["compute_ms_per_image"],
        "pipeline_images_per_s": measured["pipeline_images_per_s"],
        "model": {k: measured[k] for k in model},
        "dense": {
            "postprocess_ms_per_image": 1000 * dense_s,
            "postprocess_share": dense_s / forward_s,
            "above_threshold_per_image": above,
        },
        "yolo": time_yolo(seconds / 2),
    }
