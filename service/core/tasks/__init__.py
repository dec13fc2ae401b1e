"""The vision tasks, one module each, and the registry a model's spec ``task`` selects from: every protocol, the
clients, the benchmarks, the rollout comparison and export's gates reach a task through here."""

from __future__ import annotations

from typing import Any

from service.core.tasks.base import OutputSpec, OutputTensor, Post, Task, Transforms, Want, Wanted
from service.core.tasks.classify import Classify, ClassifyOptions
from service.core.tasks.detect import Detect, DetectOptions
from service.core.tasks.options import Field, Options, fields
from service.core.tasks.segment import Segment, SegmentOptions
from service.core.tasks.semantic import Semantic, SemanticOptions

TASKS: dict[str, type[Task]] = {task.name: task for task in (Classify, Detect, Segment, Semantic)}


def task_for(spec: Any) -> Task:
    """The task of a model, from its spec."""
    return TASKS[spec.task](spec)


def task_named(name: str) -> type[Task]:
    """A task by its name (the image API's route, a command's name)."""
    return TASKS[name]


__all__ = [
    "TASKS", "Classify", "ClassifyOptions", "Detect", "DetectOptions", "Field", "Options", "OutputSpec",
    "OutputTensor", "Post", "Segment", "SegmentOptions", "Semantic", "SemanticOptions", "Task", "Transforms",
    "Want", "Wanted", "fields", "task_for", "task_named",
]  # fmt: skip
