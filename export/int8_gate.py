"""What an INT8 artifact is judged on against fp32, by task (README, "INT8"), and the verdict the export report prints.

A classifier (:class:`Top1Judge`): top-1 agreement with fp32, and accuracy where labels are known. A detector
(:class:`BoxJudge`): fp32's detections are each held-out image's truth, and int8's are held to them by mAP@0.5
(models/detection_eval.py's definition); both read the graph's rows as the server does (its layout, suppressed alike).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from service.core.errors import ConfigError
from service.core.spec import Int8Record, Int8Speed, ModelSpec
from service.core.status import InferResult
from service.core.tasks import Detect, DetectOptions, task_named

MIN_BOX_MAP = 0.95
TRUTH_SCORE = DetectOptions().score_threshold  # fp32's detections at the served default are the reference's boxes
AP_SCORE = 0.05  # int8's detections from here on are scored (models/detection_eval.py's threshold)
Truth = Sequence[tuple[np.ndarray, np.ndarray]]  # per image: boxes [G, 4] in input pixels, class indices [G]
NO_INT8_DATA = (
    "--int8 needs real images to calibrate on and to gate against fp32 (on held-out ones): pass "
    "--calibration-images DIR (half calibrate, half are held out; class sub-folders named as the labels add an "
    "accuracy check), or export a checkpoint whose dataset is at hand (a detector's: its held-out canvases); for "
    "speed work on a model whose predictions mean nothing, --int8-ungated calibrates on generated images and marks "
    "the artifact ungated"
)


class Top1Judge:
    """A classifier's judge. Every judge gives the ``agreement`` of int8's outputs with fp32's on the same images and
    the ``accuracy`` of outputs against the images' labels (class indices, or boxes and classes), both 0..1, and
    ``record``s the figures' fields of :class:`Int8Record`."""

    def __init__(self, minimum: float, max_drop: float) -> None:
        self.minimum, self.max_drop = minimum, max_drop

    def agreement(self, got: np.ndarray, reference: np.ndarray) -> float:
        return float((got.argmax(1) == reference.argmax(1)).mean())

    def accuracy(self, outputs: np.ndarray, truth: Any) -> float:
        return float((outputs.argmax(1) == truth).mean())

    def record(self, agreement: float, fp32: float | None, int8: float | None) -> dict[str, Any]:
        return {"top1_agreement": agreement, "min_top1_agreement": self.minimum, "fp32_accuracy": fp32,
                "int8_accuracy": int8}  # fmt: skip


class BoxJudge:
    def __init__(self, spec: ModelSpec, minimum: float, max_drop: float) -> None:
        self.spec, self.minimum, self.max_drop = spec, minimum, max_drop

    def _found(self, outputs: np.ndarray, threshold: float) -> list[Any]:
        from models.detection_eval import Detections

        options = DetectOptions(score_threshold=threshold, max_detections=self.spec.max_detections)
        found = Detect(self.spec).kept(InferResult({"output": outputs}, [None] * len(outputs)), options)
        return [Detections(kept[:, :4], kept[:, 4], kept[:, 5].astype(np.int64)) for kept in found]

    def _map(self, outputs: np.ndarray, truth: Truth) -> float:
        from models.detection_eval import average_precision

        report = average_precision(self._found(outputs, AP_SCORE), truth, num_classes=self.spec.num_classes)
        if np.isnan(report.mean):  # no box to find anywhere: right only when none was found either
            return 1.0 if not any(len(d.boxes) for d in self._found(outputs, TRUTH_SCORE)) else 0.0
        return report.mean

    def agreement(self, got: np.ndarray, reference: np.ndarray) -> float:
        truth = [(d.boxes, d.classes) for d in self._found(reference, TRUTH_SCORE)]
        return self._map(got, truth)

    def accuracy(self, outputs: np.ndarray, truth: Any) -> float:
        return self._map(outputs, truth)

    def record(self, agreement: float, fp32: float | None, int8: float | None) -> dict[str, Any]:
        return {"box_map50_vs_fp32": agreement, "min_box_map50": self.minimum, "fp32_map50": fp32, "int8_map50": int8}


Judge = Top1Judge | BoxJudge


def judge_for(spec: ModelSpec | None, *, min_top1: float, max_drop: float, min_box_map: float) -> Judge:
    """The judge of ``spec``'s task (a classifier's where no spec is given); a segmenter's is refused (its gate on
    masks, int8's against fp32's, is not built: a box judge would pass masks it never looked at)."""
    gate = task_named(spec.task).gate if spec is not None else "top1"
    if gate not in ("top1", "boxes"):
        raise ConfigError(f"--int8 of {spec.name if spec else 'this model'} is refused: INT8 is gated on top-1 or on "
                          f"boxes, and this model is judged on {gate}: export it in fp32")  # fmt: skip
    if spec is not None and gate == "boxes":
        return BoxJudge(spec, min_box_map, max_drop)
    return Top1Judge(min_top1, max_drop)


def passed(judge: Judge, agreement: float, fp32: float | None, int8: float | None) -> bool:
    """Agreement at least the judge's minimum and, where labels are known, at most ``max_drop`` lost."""
    return agreement >= judge.minimum and (fp32 is None or int8 is None or int8 >= fp32 - judge.max_drop - 1e-12)


@dataclass
class Int8Verdict:
    """The gate's outcome, in the shape the export report prints for every artifact."""

    record: Int8Record
    max_rel_error: float
    hints: list[str] = field(default_factory=list)
    checked: bool = True

    @property
    def images(self) -> int:
        return self.record.held_out_images

    @property
    def top1_agreement(self) -> float:
        """The agreement the gate judged (a detector's: mAP@0.5 against fp32's boxes)."""
        r = self.record
        return r.top1_agreement if r.top1_agreement is not None else (r.box_map50_vs_fp32 or 0.0)

    @property
    def passed(self) -> bool:
        """Whether the artifact may be written: it met both gates (accuracy, then speed), or they were waived."""
        speed = self.record.speed
        fast_enough = speed is None or speed.passed or speed.allowed_slower
        return (self.record.passed or not self.record.gated) and fast_enough

    def describe(self) -> str:
        r = self.record
        verdict = ("pass" if r.passed else "FAIL") if r.gated else f"UNGATED, would {'pass' if r.passed else 'FAIL'}"
        speed, text = r.speed, ""
        if speed is not None and not speed.passed:
            verdict = "NOT FASTER than fp32, written anyway" if speed.allowed_slower else "FAIL, not faster than fp32"
            verdict += "" if r.gated else ", UNGATED"
            text = describe_speed(speed) + "; "
        text += _agreement(r)
        fp32, int8 = (
            (r.fp32_accuracy, r.int8_accuracy) if r.top1_agreement is not None else (r.fp32_map50, r.int8_map50)
        )
        if fp32 is not None and int8 is not None:
            drop = fp32 - int8
            what = "accuracy" if r.top1_agreement is not None else "mAP@0.5 on the labelled boxes"
            text += (
                f", {what} {int8:.2%} against fp32's {fp32:.2%} "
                f"({'-' if drop >= 0 else '+'}{abs(drop) * 100:.2f} points, limit -{r.max_accuracy_drop * 100:.0f}"
                + (f": over by {(drop - r.max_accuracy_drop) * 100:.2f} points" if drop > r.max_accuracy_drop else "")
                + ")"
            )
        text += (
            f" on {r.held_out_images} held-out images ({r.held_out_source}); max relative output error "
            f"{self.max_rel_error:.2e}; calibrated with {r.calibration_method} on {r.calibration_images} images "
            f"({r.calibration_source})"
        )
        if speed is not None and speed.passed:
            text += "; " + describe_speed(speed)
        if self.hints:  # set where a gate failed
            text += ". Try: " + "; ".join(self.hints)
        return f"{verdict}: {text}"


def _agreement(r: Int8Record) -> str:
    if r.top1_agreement is not None and r.min_top1_agreement is not None:
        return (
            f"top-1 agreement with fp32 {r.top1_agreement:.2%} (limit {r.min_top1_agreement:.0%}"
            f"{_short_by(r.top1_agreement, r.min_top1_agreement, r.held_out_images)})"
        )
    value, limit = r.box_map50_vs_fp32 or 0.0, r.min_box_map50 or 0.0
    short = f": short by {(limit - value) * 100:.2f} points" if value < limit else ""
    return f"mAP@0.5 of int8's boxes against fp32's {value:.2%} (limit {limit:.0%}{short})"


def describe_speed(speed: Int8Speed) -> str:
    """The speed gate's figures in one line: each batch size's medians and ratio, and the limit."""
    sizes = ", ".join(
        f"batch {n} int8 {speed.int8_median_ms[n]:.3g} ms against fp32 {fp32:.3g} ms "
        f"({speed.int8_median_ms[n] / fp32:.2f}x)"
        for n, fp32 in speed.fp32_median_ms.items()
    )
    where = f"{speed.device}, {speed.cpu}" if speed.cpu else speed.device
    return (
        f"speed on {where} ({speed.provider}, median of {speed.runs} runs each, in alternating blocks): "
        f"{sizes}; "
        f"int8 / fp32 {speed.ratio:.2f}x, limit {1 - speed.min_speedup:.2f}x"
    )


def _short_by(value: float, limit: float, images: int) -> str:
    if value >= limit:
        return ""
    missing = int(np.ceil(limit * images - value * images - 1e-9))
    return f": short by {(limit - value) * 100:.2f} points, {missing} more of {images} images had to agree"
