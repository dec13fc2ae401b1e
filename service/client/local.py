"""A task's answers in this process, with no server: what ``visionserve classify`` and ``visionserve detect`` do
without ``--url``.

The model is loaded from the repository through the runtimes the server uses (:func:`make_runtime`, the same
backend choice), images are decoded by the server's CPU pool (:class:`Preprocessor`, the same limits, messages and
per-image transforms), and answers come from the model's task as the server's do (its options, checked alike, and
:meth:`~service.core.tasks.Task.postprocess`), so a folder gives the same answers either way. This is the one
module of the client that needs the runtimes; the HTTP client never imports it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import msgspec
import numpy as np

from service.core.boxes import Transform
from service.core.config import ModelConfig
from service.core.decoding import Preprocessor
from service.core.errors import BadInputError, ConfigError, VisionServeError
from service.core.repository import ModelRepository
from service.core.status import InferResult
from service.core.tasks import Want, task_for, task_named
from service.runtime import RuntimeLike, choose_backend, make_runtime

R = TypeVar("R", bound=msgspec.Struct)


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
        self.task = task_for(self.version.spec)

    def require(self, task: str) -> None:
        """Refuse the command of another task (``visionserve classify`` of a detector: ConfigError naming the
        command that fits), as the image routes refuse the route of another task."""
        if self.task.name != task_named(task).name:
            raise ConfigError(
                f"model {self.model!r} is a {self.task.name} model: visionserve {task} does not fit it; run "
                f"visionserve {self.task.name} instead"
            )

    def options(self, values: Mapping[str, Any]) -> Any:
        """The task's options from ``values`` (the command's flags), checked as the image route checks its query
        (a bad one, a ConfigError naming it)."""
        try:
            return self.task.options({k: v for k, v in values.items() if v is not None})
        except BadInputError as exc:
            raise ConfigError(str(exc)) from None

    def answer(
        self, images: Sequence[bytes], options: Any, result: type[R], *, names: Sequence[str | None] | None = None
    ) -> list[R]:
        """One ``result`` per encoded image, in order: the task's answer with ``options`` (a classifier's top-k, a
        detector's boxes in the image's own pixels), or its own error."""
        named = list(names or [None] * len(images))
        results: list[R | None] = [None] * len(images)
        futures = [self.pool.submit(data) for data in images]
        decoded: list[tuple[int, np.ndarray, Transform | None]] = []
        for i, future in enumerate(futures):
            try:
                decoded.append((i, future.result(), future.transform))
            except VisionServeError as exc:
                results[i] = result(filename=named[i], model=self.model, version=self.version.version, error=str(exc))
        want = Want(options=options)
        for start in range(0, len(decoded), self.max_batch_size):
            chunk = decoded[start : start + self.max_batch_size]
            try:
                outputs = self.runtime.submit_outputs(np.stack([pixels for _, pixels, _ in chunk])).result()
                post = self.task.postprocess(InferResult(outputs, [None] * len(chunk)), want, [t for *_, t in chunk])
            except VisionServeError as exc:
                for i, _, _ in chunk:
                    results[i] = result(filename=named[i], model=self.model, version=self.version.version,
                                        error=str(exc))  # fmt: skip
                continue
            for (i, _, shown), rows in zip(chunk, post.predictions, strict=True):
                answer = {"filename": named[i], "model": self.model, "version": self.version.version}
                results[i] = msgspec.convert({**answer, **self.task.fields(rows, shown)}, result)
        return [r for r in results if r is not None]

    def close(self) -> None:
        self.runtime.close()
        self.pool.close()
