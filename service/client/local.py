"""Classifying or detecting in this process, with no server: what ``visionserve classify`` and ``visionserve
detect`` do without ``--url``.

The model is loaded from the repository through the runtimes the server uses (:func:`make_runtime`, the same
backend choice), images are decoded by the server's CPU pool (:class:`Preprocessor`, the same limits, messages and
per-image transforms), and answers come from the same functions: softmax top-k, or the server's suppression and its
mapping of boxes back to the image's own pixels (:mod:`service.core.boxes`), so a folder gives the same answers
either way. This is the one module of the client that needs the runtimes; the HTTP client never imports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from service.client.kinds import DetectedImage
from service.core.answers import Detection, ImageResult, Prediction
from service.core.boxes import DetectOptions, Transform, class_indices, listed, to_original
from service.core.config import ModelConfig
from service.core.decoding import Preprocessor
from service.core.errors import BadInputError, ConfigError, VisionServeError
from service.core.layouts import image_rows, keep, suppresses
from service.core.repository import ModelRepository
from service.core.scores import softmax
from service.core.scores import top_k as best_k
from service.runtime import RuntimeLike, choose_backend, make_runtime


def resolve_device(config: ModelConfig, device: str) -> str:
    """``device``, or for "auto" the model's configured device, "auto" there meaning CUDA when usable."""
    wanted = config.device if device == "auto" else device
    if wanted != "auto":
        return wanted
    try:
        import torch

        return "cuda:0" if torch.cuda.is_available() else "cpu"
    except Exception:  # no torch, or a broken driver: the CPU, as the server decides
        return "cpu"


class LocalModel:
    """One model version loaded in this process; :meth:`classify` and :meth:`detect` answer as the image API's
    routes do."""

    def __init__(self, repository: str, model: str, *, version: int | None = None, device: str = "auto") -> None:
        entry = ModelRepository(repository).model(model)
        self.model = model
        self.version = entry.version(version)
        config = entry.config
        self.device = resolve_device(config, device)
        self.backend = choose_backend(self.version, config, self.device)
        self.max_batch_size = config.max_batch_size
        self.runtime: RuntimeLike = make_runtime(self.version, config, self.backend, self.device)
        self.pool = Preprocessor(self.version.spec)
        self.task = self.version.spec.task
        self.layout = self.version.spec.output_layout

    def require(self, task: str) -> None:
        """Refuse the command of another task (``visionserve classify`` of a detector: ConfigError naming the
        command that fits), as the image routes refuse the route of another task."""
        if self.task != task:
            fits = "detect" if self.task == "detect" else "classify"
            raise ConfigError(
                f"model {self.model!r} is a {self.task} model: visionserve {task} does not fit it; run "
                f"visionserve {fits} instead"
            )

    def classify(
        self, images: Sequence[bytes], *, top_k: int = 5, names: Sequence[str | None] | None = None
    ) -> list[ImageResult]:
        """One result per encoded image, in order: its top-k, or its own error."""
        labels = self.version.spec.labels
        results = [
            ImageResult(filename=name, model=self.model, version=self.version.version)
            for name in (names or [None] * len(images))
        ]
        decoded = self.pool.decode_many(images)
        good = [i for i, d in enumerate(decoded) if isinstance(d, np.ndarray)]
        for i, d in enumerate(decoded):
            if isinstance(d, VisionServeError):
                results[i].error = str(d)
        for start in range(0, len(good), self.max_batch_size):
            rows = good[start : start + self.max_batch_size]
            try:
                logits = self.runtime.run(np.stack([decoded[i] for i in rows]))  # type: ignore[misc]
            except VisionServeError as exc:
                for i in rows:
                    results[i].error = str(exc)
                continue
            idx, scores = best_k(softmax(logits), top_k)
            for row, i in enumerate(rows):
                results[i].predictions = [
                    Prediction(label=labels[int(c)], index=int(c), score=float(s))
                    for c, s in zip(idx[row], scores[row], strict=True)
                ]
        return results

    def detect(
        self, images: Sequence[bytes], options: DetectOptions, *, names: Sequence[str | None] | None = None
    ) -> list[DetectedImage]:
        """One result per encoded image, in order: its size as a viewer shows it and its detections (the server's
        suppression with ``options``, boxes in its own pixels, best first), or its own error."""
        results = [
            DetectedImage(filename=name, model=self.model, version=self.version.version)
            for name in (names or [None] * len(images))
        ]
        futures = [self.pool.submit(data) for data in images]
        decoded: list[tuple[np.ndarray, Transform]] = []
        good: list[int] = []
        for i, future in enumerate(futures):
            try:
                pixels = future.result()
            except VisionServeError as exc:
                results[i].error = str(exc)
                continue
            assert future.transform is not None  # set with the pixels
            decoded.append((pixels, future.transform))
            good.append(i)
        for start in range(0, len(good), self.max_batch_size):
            rows = list(range(start, min(start + self.max_batch_size, len(good))))
            try:
                outputs = self.runtime.submit_outputs(np.stack([decoded[r][0] for r in rows])).result()
            except VisionServeError as exc:
                for r in rows:
                    results[good[r]].error = str(exc)
                continue
            found = image_rows(self.layout, outputs, len(self.version.spec.labels), options.score_threshold)
            for r, candidates in zip(rows, found, strict=True):
                where = decoded[r][1]
                kept = to_original(keep(self.layout, candidates, options), where)
                result = results[good[r]]
                result.width, result.height = where.width, where.height
                result.detections = [Detection(**d) for d in listed(kept, where, options, self.version.spec.labels)]
        return results

    def close(self) -> None:
        self.runtime.close()
        self.pool.close()


def detect_options(
    model: LocalModel,
    *,
    classes: Sequence[str] | None = None,
    iou_threshold: float | None = None,
    class_agnostic: bool | None = None,
    **options: Any,
) -> DetectOptions:
    """``options`` (the flags, checked by argparse) with ``classes`` named by label or index, as the detect route
    takes them; an unknown class, or a suppression option for a graph that suppresses its own boxes, is a
    ConfigError, as the route refuses them."""
    given = [name for name, value in (("--iou-threshold", iou_threshold), ("--class-agnostic", class_agnostic))
             if value is not None]  # fmt: skip
    if given and not suppresses(model.layout):
        raise ConfigError(
            f"{' and '.join(given)}: the graph of {model.model!r} suppresses its own boxes (output_layout "
            f"{model.layout}), so nothing is suppressed here; --score-threshold, --classes and --max-detections apply"
        )
    try:
        indices = class_indices("--classes", classes or (), model.version.spec.labels)
    except BadInputError as exc:
        raise ConfigError(str(exc)) from None
    return DetectOptions(
        iou_threshold=0.45 if iou_threshold is None else iou_threshold, class_agnostic=bool(class_agnostic),
        classes=None if classes is None else indices, **options,
    )  # fmt: skip
