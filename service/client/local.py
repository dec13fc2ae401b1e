"""Classifying in this process, with no server: what ``visionserve classify`` does without ``--url``.

The model is loaded from the repository through the runtimes the server uses (:func:`make_runtime`, the same
backend choice), images are decoded by the server's CPU pool (:class:`Preprocessor`, the same limits and
messages), and scores are the same softmax top-k, so a folder gives the same answers either way. This is the one
module of the client that needs the runtimes; the HTTP client never imports it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from service.core.answers import ImageResult, Prediction
from service.core.config import ModelConfig
from service.core.decoding import Preprocessor
from service.core.errors import VisionServeError
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


class LocalClassifier:
    """One model version loaded in this process; :meth:`classify` answers as the image API does."""

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

    def close(self) -> None:
        self.runtime.close()
        self.pool.close()
