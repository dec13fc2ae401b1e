"""Checking a detector's answers under load against a reference: the boxes known to be in each image, a JSON file of
image name -> ``[{"box": [x1, y1, x2, y2], "label": "3"}, ...]`` (README, "Detectors, answers checked", which states
the matching rule). It can hold the boxes an image was made with (generated canvases:
``service/bench/detect_served.py``) or another run's answers. The check counts images, not requests.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from service.core.boxes import match

MATCH_IOU = 0.5


@dataclass(frozen=True)
class Known:
    """One box known to be in an image: xyxy in its own pixels, and its label."""

    box: tuple[float, float, float, float]
    label: str


Reference = Mapping[str, Sequence[Known]]


def load_reference(path: str | Path) -> dict[str, list[Known]]:
    """A reference file's known boxes per image name; ValueError (naming the file and the entry) when malformed."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the reference {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"the reference {path} must be a JSON object of image name -> list of boxes")
    out: dict[str, list[Known]] = {}
    for name, boxes in raw.items():
        try:
            out[name] = [_known(b) for b in boxes]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"the reference {path}: {name!r} needs a list of {{box: [x1, y1, x2, y2], label}}; {exc}"
            ) from exc
    return out


def _known(entry: Mapping[str, Any]) -> Known:
    x1, y1, x2, y2 = (float(v) for v in entry["box"])
    return Known((x1, y1, x2, y2), str(entry["label"]))


def write_reference(path: str | Path, reference: Reference) -> Path:
    """Write ``reference`` as a reference file (the format :func:`load_reference` reads)."""
    data = {name: [{"box": list(k.box), "label": k.label} for k in boxes] for name, boxes in reference.items()}
    Path(path).write_text(json.dumps(data, indent=0))
    return Path(path)


def found(detections: Sequence[Mapping[str, Any]], known: Sequence[Known]) -> int:
    """How many of ``known`` the ``detections`` (the answer's ``{"box", "label", "score"}``, xyxy) find, one to
    one, the best scored detection first (:func:`service.core.boxes.match`, as a detector's rollout matches)."""
    classes: dict[str, int] = {}
    rows = np.array(
        [[*d["box"], float(d.get("score", 0.0)), classes.setdefault(str(d.get("label")), len(classes))]
         for d in detections], dtype=np.float32,
    ).reshape(-1, 6)  # fmt: skip
    truth = np.array([[*k.box, 0.0, classes.setdefault(k.label, len(classes))] for k in known], dtype=np.float32)
    return len(match(rows, truth.reshape(-1, 6), MATCH_IOU)[0])


@dataclass
class AnswerCheck:
    """Counts of a check: images answered and checked, those whose answer matched, the known boxes found, the
    detections answered, images answered with an error, answers that were not a detect answer, and images
    that the reference does not name (not checked)."""

    images: int = 0
    matching: int = 0
    known: int = 0
    found: int = 0
    detections: int = 0
    image_errors: int = 0
    unreadable: int = 0
    not_in_reference: int = 0

    @property
    def share(self) -> float:
        """The share of checked images whose answer matched (0 when none was checked)."""
        return self.matching / self.images if self.images else 0.0

    def summary(self) -> dict[str, Any]:
        recall = self.found / self.known if self.known else None
        precision = self.found / self.detections if self.detections else None
        return asdict(self) | {"share_matching": self.share, "recall": recall, "precision": precision}


def check(answers: Iterable[tuple[Sequence[str], bytes]], reference: Reference) -> AnswerCheck:
    """Check each answer body (``/detect``'s or ``/segment``'s JSON) of a request whose images had these names, in
    order."""
    out = AnswerCheck()
    for names, body in answers:
        try:
            results = json.loads(body)["results"]
            if len(results) != len(names):
                raise ValueError("one result per image")
        except (ValueError, KeyError, TypeError):
            out.unreadable += 1
            continue
        for name, result in zip(names, results, strict=True):
            known = reference.get(name)
            if known is None:
                out.not_in_reference += 1
                continue
            out.images += 1
            detections = result.get("detections", result.get("instances"))  # a segmenter's instances are boxes too
            if "error" in result or detections is None:
                out.image_errors += 1
                continue
            hits = found(detections, known)
            out.known += len(known)
            out.found += hits
            out.detections += len(detections)
            out.matching += hits == len(known) == len(detections)
    return out


def line(summary: Mapping[str, Any]) -> str:
    """One line for a person: the share of answers matching, and what did not."""
    recall, precision = summary["recall"], summary["precision"]
    text = (
        f"answers checked: {summary['images']} images, {100 * summary['share_matching']:.1f}% matching the reference"
        f" (known boxes found {percent(recall)}, detections that found one {percent(precision)})"
    )
    problems = [f"{summary[k]} {k.replace('_', ' ')}" for k in ("image_errors", "unreadable", "not_in_reference")]
    return text + "".join(f"; {p}" for p in problems if not p.startswith("0 "))


def percent(value: float | None) -> str:
    """A share as a percentage to one decimal; "-" for none."""
    return "-" if value is None else f"{100 * value:.1f}%"
