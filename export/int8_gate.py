"""What an INT8 artifact is judged on against fp32, by task (README, "INT8"), and the verdict the export report prints.

A classifier (:class:`Top1Judge`): top-1 agreement with fp32, and accuracy where labels are known. A detector
(:class:`BoxJudge`): fp32's detections are each held-out image's truth, and int8's are held to them by mAP@0.5
(models/detection_eval.py's definition); both read the graph's rows as the server does (its layout, suppressed alike).
A segmenter (:class:`MaskJudge`): likewise on its instances' masks, by pycocotools' COCOeval (iouType "segm").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from service.core.errors import ConfigError
from service.core.layouts import seg_outputs
from service.core.spec import Int8Record, Int8Speed, ModelSpec
from service.core.status import InferResult
from service.core.tasks import Detect, DetectOptions, task_named

MIN_BOX_MAP = 0.95
MIN_MASK_MAP = 0.95
TRUTH_SCORE = DetectOptions().score_threshold  # fp32's detections at the served default are the reference's boxes
AP_SCORE = 0.05  # int8's detections from here on are scored (models/detection_eval.py's threshold)
Truth = Sequence[tuple[np.ndarray, np.ndarray]]  # per image: boxes [G, 4] in input pixels, class indices [G]
Outputs = dict[str, np.ndarray]  # a batch's outputs by the graph's names (a segmenter's head and prototypes)
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

    def agreement(self, got: Outputs, reference: Outputs) -> float:
        return float((_first(got).argmax(1) == _first(reference).argmax(1)).mean())

    def accuracy(self, outputs: Outputs, truth: Any) -> float:
        return float((_first(outputs).argmax(1) == truth).mean())

    def record(self, agreement: float, fp32: float | None, int8: float | None) -> dict[str, Any]:
        return {"top1_agreement": agreement, "min_top1_agreement": self.minimum, "fp32_accuracy": fp32,
                "int8_accuracy": int8}  # fmt: skip


class BoxJudge:
    def __init__(self, spec: ModelSpec, minimum: float, max_drop: float) -> None:
        self.spec, self.minimum, self.max_drop = spec, minimum, max_drop

    def _found(self, outputs: Outputs, threshold: float) -> list[Any]:
        from models.detection_eval import Detections

        options = DetectOptions(score_threshold=threshold, max_detections=self.spec.max_detections)
        found = Detect(self.spec).kept(InferResult(outputs, [None] * len(_first(outputs))), options)
        return [Detections(kept[:, :4], kept[:, 4], kept[:, 5].astype(np.int64)) for kept in found]

    def _map(self, outputs: Outputs, truth: Any) -> float:
        from models.detection_eval import average_precision

        report = average_precision(self._found(outputs, AP_SCORE), truth, num_classes=self.spec.num_classes)
        if np.isnan(report.mean):  # no box to find anywhere: right only when none was found either
            return 1.0 if not any(len(d.boxes) for d in self._found(outputs, TRUTH_SCORE)) else 0.0
        return report.mean

    def agreement(self, got: Outputs, reference: Outputs) -> float:
        truth = [(d.boxes, d.classes) for d in self._found(reference, TRUTH_SCORE)]
        return self._map(got, truth)

    def accuracy(self, outputs: Outputs, truth: Any) -> float:
        return self._map(outputs, truth)

    def record(self, agreement: float, fp32: float | None, int8: float | None) -> dict[str, Any]:
        return {"box_map50_vs_fp32": agreement, "min_box_map50": self.minimum, "fp32_map50": fp32, "int8_map50": int8}


class MaskJudge(BoxJudge):
    """A segmenter's: the box judge's, on masks. Instances as the server answers them, held to the truth (fp32's
    instances, or the held-out images' known masks: a COCO annotations document) by mask AP@0.5 of pycocotools'
    COCOeval, iouType "segm" (models/segment_train.py's, which scores its training)."""

    def _found(self, outputs: Outputs, threshold: float = AP_SCORE) -> list[dict[str, Any]]:
        from models.segment_train import served_results  # COCO results scored from 0.05, as AP_SCORE

        head, protos = seg_outputs(outputs)
        found = served_results((outputs[head], outputs[protos]), self.spec, 1)
        return [r for r in found if r["score"] >= threshold]

    def _map(self, outputs: Outputs, truth: Any) -> float:
        from models.segment_train import segm_ap

        if not truth["annotations"]:  # nothing to find anywhere: right only when nothing was found either
            return 0.0 if self._found(outputs, TRUTH_SCORE) else 1.0
        return segm_ap(truth, self._found(outputs))[1]

    def agreement(self, got: Outputs, reference: Outputs) -> float:
        size = {"height": self.spec.input.height, "width": self.spec.input.width}  # the answers' pixels: the input's
        return self._map(got, {
            "images": [{"id": i + 1, **size} for i in range(len(_first(reference)))],
            # "area" is read by COCO's size ranges alone; AP@0.5 is over every size
            "annotations": [{**r, "id": k + 1, "iscrowd": 0, "area": r["bbox"][2] * r["bbox"][3]}
                            for k, r in enumerate(self._found(reference, TRUTH_SCORE))],
            "categories": [{"id": c, "name": name} for c, name in enumerate(self.spec.labels)],
        })  # fmt: skip

    def record(self, agreement: float, fp32: float | None, int8: float | None) -> dict[str, Any]:
        return {"mask_map50_vs_fp32": agreement, "min_mask_map50": self.minimum, "fp32_mask_map50": fp32,
                "int8_mask_map50": int8}  # fmt: skip


Judge = Top1Judge | BoxJudge | MaskJudge


def judge_for(spec: ModelSpec | None, *, min_top1: float, max_drop: float, min_box_map: float,
              min_mask_map: float = MIN_MASK_MAP) -> Judge:  # fmt: skip
    """The judge of ``spec``'s task (a classifier's where no spec is given); a task judged on anything else (a
    semantic model's pixels) is refused: a judge of another task would pass outputs it never looked at."""
    gate = task_named(spec.task).gate if spec is not None else "top1"
    if gate not in ("top1", "boxes", "masks"):
        raise ConfigError(f"--int8 of {spec.name if spec else 'this model'} is refused: INT8 is gated on top-1, "
                          f"boxes or masks, and this model is judged on {gate}: export it in fp32")  # fmt: skip
    if spec is not None and gate != "top1":
        return MaskJudge(spec, min_mask_map, max_drop) if gate == "masks" else BoxJudge(spec, min_box_map, max_drop)
    return Top1Judge(min_top1, max_drop)


def _first(outputs: Outputs) -> np.ndarray:
    return next(iter(outputs.values()))  # a classifier's logits, a one-output detector's rows


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
        """The agreement the gate judged (a detector's: mAP@0.5 against fp32's boxes; a segmenter's, masks)."""
        r = self.record
        return next((a for a in (r.top1_agreement, r.box_map50_vs_fp32, r.mask_map50_vs_fp32) if a is not None), 0.0)

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
        masks = r.mask_map50_vs_fp32 is not None
        fp32, int8 = (
            (r.fp32_accuracy, r.int8_accuracy) if r.top1_agreement is not None
            else (r.fp32_mask_map50, r.int8_mask_map50) if masks else (r.fp32_map50, r.int8_map50)
        )  # fmt: skip
        if fp32 is not None and int8 is not None:
            drop = fp32 - int8
            what = f"mAP@0.5 on the labelled {'masks' if masks else 'boxes'}"
            what = "accuracy" if r.top1_agreement is not None else what
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
    masks = r.mask_map50_vs_fp32 is not None
    value, limit = (r.mask_map50_vs_fp32, r.min_mask_map50) if masks else (r.box_map50_vs_fp32, r.min_box_map50)
    value, limit = value or 0.0, limit or 0.0
    short = f": short by {(limit - value) * 100:.2f} points" if value < limit else ""
    what = "mask mAP@0.5 of int8's instances" if masks else "mAP@0.5 of int8's boxes"
    return f"{what} against fp32's {value:.2%} (limit {limit:.0%}{short})"


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
