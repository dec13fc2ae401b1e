"""Objects tracked across a stream's frames, and counted through lines and zones. numpy only. What a stream asks and
gets, how lines and zones count and why the tracker is our own: docs/tracking.md.

:class:`ByteTrack` is ByteTrack's association (Zhang et al., 2022; as roboflow/trackers writes it) on the frames'
timestamps (seconds, not their count: a gap the latest-frame-wins policy left is a gap the motion model crosses),
with an alpha-beta filter on the box's corners and greedy matching by IoU (no scipy in the serving install).
:class:`Counter` counts tracks through :class:`Line` s and :class:`Zone` s, a side or inside state changing only past
a dead band (:data:`BAND_PX`) so that a box jittering on a line counts once.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec
import numpy as np

from service.core.boxes import iou_matrix
from service.core.errors import BadInputError, shown
from service.core.tasks.base import OutputTensor

MAX_LINES = MAX_ZONES = 16
MAX_POINTS = 64  # a zone's polygon
BAND_PX = 2.0  # an anchor this close to a line or a zone's edge keeps the side it had
ALPHA, BETA = 0.7, 0.3  # the motion filter's gains on position and velocity (per update)
SAME = 0.5  # a box overlapping one tracked this frame by more is the same object, read again
Unit = Annotated[float, msgspec.Meta(ge=0, le=1)]


class TrackSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """ByteTrack's settings (docs/tracking.md): ``activation_threshold``, the score a box needs to start a track;
    ``high_threshold``, the score that makes a box confident (matched first); ``matching_iou``, the least IoU of a
    match; ``lost_track_buffer_s``, how long a track unseen is kept; ``minimum_consecutive_frames``, the frames a new
    track must be seen in a row before it has an id."""

    activation_threshold: Unit = 0.5
    high_threshold: Unit = 0.5
    matching_iou: Unit = 0.2
    lost_track_buffer_s: Annotated[float, msgspec.Meta(ge=0, le=600)] = 1.0
    minimum_consecutive_frames: Annotated[int, msgspec.Meta(ge=1, le=100)] = 1


@dataclass
class _Track:
    box: np.ndarray  # x1, y1, x2, y2 as estimated
    observed: np.ndarray  # as last seen
    seen: float  # when (the frames' time, seconds)
    id: int  # -1 until confirmed
    votes: dict[int, float]  # its labels, weighted by score: its label is the most
    velocity: np.ndarray = field(default_factory=lambda: np.zeros(4))  # its corners' pixels per second
    streak: int = 1  # frames matched in a row

    @property
    def label(self) -> int:
        return max(self.votes, key=self.votes.__getitem__)


class ByteTrack:
    """One stream's tracks: :meth:`update` with each frame's boxes gives each box its track id (-1: none yet)."""

    def __init__(self, settings: TrackSettings | None = None) -> None:
        self.settings = settings or TrackSettings()
        self.tracks: list[_Track] = []
        self.last_t: float | None = None
        self.next_id = 1
        self.dropped: list[int] = []  # the ids of the tracks the last update dropped

    def update(self, boxes: np.ndarray, scores: np.ndarray, labels: np.ndarray, t: float) -> np.ndarray:
        """Each of ``boxes`` ``[N, 4]`` (its ``scores`` and ``labels``), seen at ``t`` seconds: its track's id."""
        s = self.settings
        boxes, scores = np.asarray(boxes, dtype=np.float64).reshape(-1, 4), np.asarray(scores, dtype=np.float64)
        labels = np.asarray(labels, dtype=np.int64)
        dt, self.last_t = (0.0 if self.last_t is None else max(t - self.last_t, 0.0)), t
        self.dropped = [k.id for k in self.tracks if t - k.seen > s.lost_track_buffer_s and k.id > 0]
        self.tracks = [k for k in self.tracks if t - k.seen <= s.lost_track_buffer_s]
        for k in self.tracks:
            k.box = k.box + k.velocity * dt  # predicted
        out = np.full(len(boxes), -1, dtype=np.int64)
        free = np.ones(len(self.tracks), dtype=bool)
        high = np.flatnonzero(scores >= s.high_threshold)
        low = np.flatnonzero((scores < s.high_threshold) & (scores >= min(0.1, s.high_threshold)))
        matched: list[tuple[int, int]] = []
        # The confident boxes to the tracks' predicted boxes, the weak ones to those left, then whatever box is left
        # to a left track's last seen box, read as its label (an object that turned while its track coasted on:
        # OC-SORT's recovery).
        stages = ((high, s.matching_iou, "box"), (low, max(s.matching_iou, 0.5), "box"),
                  (np.concatenate([high, low]), s.matching_iou, "observed"))  # fmt: skip
        for group, least, at in stages:
            used = {b for _, b in matched}
            group = np.array([i for i in group.tolist() if i not in used], dtype=np.int64)
            left = np.flatnonzero(free)
            iou = iou_matrix(np.array([getattr(self.tracks[k], at) for k in left]).reshape(-1, 4), boxes[group])
            if at == "observed":
                iou *= np.array([self.tracks[k].label for k in left])[:, None] == labels[group]
            for track, box in _greedy(iou, least):
                matched.append((int(left[track]), int(group[box])))
                free[left[track]] = False
        for track, box in matched:
            k = self.tracks[track]
            residual = boxes[box] - k.box
            k.box = k.box + ALPHA * residual
            k.velocity = k.velocity + BETA * residual / dt if dt > 0 else k.velocity
            k.observed, k.seen, k.streak = boxes[box], t, k.streak + 1
            k.votes[int(labels[box])] = k.votes.get(int(labels[box]), 0.0) + float(scores[box])
            if k.id < 0 and k.streak >= s.minimum_consecutive_frames:
                k.id, self.next_id = self.next_id, self.next_id + 1
            out[box] = k.id
        for track in np.flatnonzero(free).tolist():
            self.tracks[track].streak = 0
        # A new track from a confident box of none, unless it is another reading of a box kept this frame (a
        # detector that suppresses class by class answers one object under two labels).
        taken = [b for _, b in matched]
        for i in sorted(set(high.tolist()) - set(taken), key=lambda i: -scores[i]):
            if scores[i] >= s.activation_threshold and not (iou_matrix(boxes[[i]], boxes[taken]) > SAME).any():
                taken.append(i)
                confirmed = s.minimum_consecutive_frames <= 1
                self.tracks.append(_Track(boxes[i], boxes[i], t, self.next_id if confirmed else -1,
                                          {int(labels[i]): float(scores[i])}))  # fmt: skip
                out[i], self.next_id = self.tracks[-1].id, self.next_id + confirmed
        return out

    def labels_of(self, ids: np.ndarray, labels: np.ndarray) -> list[int]:
        """Each tracked box's track's label (the one its boxes were read as most, by score), an untracked one's own:
        what a line or zone counts it as (a digit misread on the frame it crosses still counts as itself)."""
        voted = {k.id: k.label for k in self.tracks}
        return [voted.get(i, int(k)) if i > 0 else int(k) for i, k in zip(ids.tolist(), labels, strict=True)]


def _greedy(iou: np.ndarray, least: float) -> list[tuple[int, int]]:
    """Pairs (row, column) of ``iou``, the best first, each row and column once, none under ``least``."""
    pairs = []
    if iou.size:
        order = np.argsort(-iou, axis=None, kind="stable")
        rows, cols = np.unravel_index(order[iou.ravel()[order] >= least], iou.shape)
        used_rows, used_cols = set(), set()
        for r, c in zip(rows.tolist(), cols.tolist(), strict=True):
            if r not in used_rows and c not in used_cols:
                pairs.append((r, c))
                used_rows.add(r)
                used_cols.add(c)
    return pairs


Anchor = Literal["center", "bottom_center"]


class Line(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A line counted through: two points (image pixels, or 0..1 with the source's ``normalized``)."""

    id: str
    points: list[list[float]]
    classes: list[str] | None = None
    anchor: Anchor = "center"


class Zone(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A polygon counted in and out of: at least 3 points, its edges never crossing."""

    id: str
    polygon: list[list[float]]
    classes: list[str] | None = None
    anchor: Anchor = "center"


def read_geometry(body: Any, labels: tuple[str, ...]) -> tuple[list[Line], list[Zone], bool]:
    """The ``lines``, ``zones`` and ``normalized`` of a source's body, each checked: BadInputError names the
    field (a line of two equal points, a polygon of fewer than 3 points or crossing itself, a coordinate that is
    not a finite number, more than the documented most, a class the model lacks)."""
    normalized = body.get("normalized", False)
    if not isinstance(normalized, bool):
        raise BadInputError(f"normalized must be true or false, got {shown(normalized)}")
    out: dict[str, list[Any]] = {}
    for key, kind, most in (("lines", Line, MAX_LINES), ("zones", Zone, MAX_ZONES)):
        items = body.get(key) or []
        if not isinstance(items, list) or len(items) > most:
            raise BadInputError(f"{key} must be a list of at most {most}, got {shown(items)}")
        try:
            out[key] = [msgspec.convert(item, kind) for item in items]
        except msgspec.ValidationError as exc:
            raise BadInputError(f"{key}: {exc}") from None
        ids = [item.id for item in out[key]]
        if len(set(ids)) != len(ids):
            raise BadInputError(f"{key}: each id once, got {ids}")
        for i, item in enumerate(out[key]):
            field = f"{key}[{i}]"
            points = item.points if kind is Line else item.polygon
            if any(len(p) != 2 or not all(math.isfinite(v) for v in p) for p in points):
                raise BadInputError(f"{field}: each point is [x, y], two finite numbers")
            unknown = sorted(set(item.classes or []) - set(labels))
            if unknown:
                raise BadInputError(f"{field}.classes: {', '.join(map(repr, unknown))} not among the model's labels")
            if kind is Line and (len(points) != 2 or points[0] == points[1]):
                raise BadInputError(f"{field}.points: two different points [[x1, y1], [x2, y2]]")
            if kind is Zone and not 3 <= len(points) <= MAX_POINTS:
                raise BadInputError(f"{field}.polygon: from 3 to {MAX_POINTS} points, got {len(points)}")
            if kind is Zone and _crosses_itself(np.asarray(points, dtype=np.float64)):
                raise BadInputError(f"{field}.polygon: its edges cross each other")
    return out["lines"], out["zones"], normalized


def _crosses_itself(p: np.ndarray) -> bool:
    """Whether two edges of the closed polygon ``p`` that are not neighbours meet (or it has no area)."""
    n = len(p)
    a, b = p, np.roll(p, -1, axis=0)
    for i in range(n):
        for j in range(i + 2, n - (i == 0)):
            if _meet(a[i], b[i], a[j], b[j]):
                return True
    return abs(_area(p)) < 1e-9


def _meet(p1: np.ndarray, p2: np.ndarray, q1: np.ndarray, q2: np.ndarray) -> bool:
    def side(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> float:
        return float(np.sign((b[0] - a[0]) * (c[1] - a[1]) - (b[1] - a[1]) * (c[0] - a[0])))

    return side(p1, p2, q1) != side(p1, p2, q2) and side(q1, q2, p1) != side(q1, q2, p2)


def _area(p: np.ndarray) -> float:
    return 0.5 * float(np.sum(p[:, 0] * np.roll(p[:, 1], -1) - np.roll(p[:, 0], -1) * p[:, 1]))


class Counter:
    """The counts of one stream's tracks through its ``lines`` and ``zones`` (in image pixels, or 0..1 of the
    frame where ``normalized``); :meth:`update` with each frame's tracked boxes answers its events."""

    def __init__(self, lines: list[Line], zones: list[Zone], normalized: bool = False) -> None:
        self.lines, self.zones, self.normalized = lines, zones, normalized
        self.side: dict[tuple[str, int], float] = {}  # (line, track) -> its anchor's side, -1 or 1
        self.inside: dict[tuple[str, int], tuple[float, str]] = {}  # (zone, track) -> since when, its label
        self.reset()

    def reset(self) -> None:
        """Every count and dwell to zero (who is inside where stays)."""
        self.crossed = {line.id: {"in": dict[str, int](), "out": dict[str, int]()} for line in self.lines}
        self.entered = {zone.id: dict[str, int]() for zone in self.zones}
        self.exited = {zone.id: dict[str, int]() for zone in self.zones}
        self.dwells: dict[str, list[float]] = {zone.id: [] for zone in self.zones}

    def update(
        self, ids: list[int], boxes: np.ndarray, labels: list[str], t: float, size: tuple[int, int], dropped: list[int]
    ) -> list[dict[str, Any]]:
        """A frame's tracked boxes (``ids``, -1 for an untracked one, ``boxes`` xyxy in the image's pixels, their
        ``labels``) at ``t`` seconds in an image of ``size`` (width, height), and the tracks the tracker dropped:
        each crossing, entry and exit, as its event."""
        events: list[dict[str, Any]] = []
        scale = np.array(size, dtype=np.float64) if self.normalized else np.ones(2)
        boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
        anchors = {"center": (boxes[:, :2] + boxes[:, 2:]) / 2,
                   "bottom_center": np.stack([(boxes[:, 0] + boxes[:, 2]) / 2, boxes[:, 3]], axis=1)}  # fmt: skip
        for line in self.lines:
            p1, p2 = np.asarray(line.points, dtype=np.float64) * scale
            span = p2 - p1
            length = float(np.hypot(*span))
            a = anchors[line.anchor] - p1
            away = (span[0] * a[:, 1] - span[1] * a[:, 0]) / length  # signed distance: > 0 on the "in" side
            along = (a @ span) / length**2  # 0..1 between the points
            for k, (track, label) in enumerate(zip(ids, labels, strict=True)):
                if track < 0 or abs(away[k]) < BAND_PX or (line.classes and label not in line.classes):
                    continue
                side, before = float(np.sign(away[k])), self.side.get((line.id, track))
                self.side[(line.id, track)] = side
                if before is not None and side != before and 0 <= along[k] <= 1:
                    direction = "in" if side > 0 else "out"
                    counts = self.crossed[line.id][direction]
                    counts[label] = counts.get(label, 0) + 1
                    events.append({"type": "event", "event": "cross", "line": line.id, "direction": direction,
                                   "track_id": track, "label": label, "time": t})  # fmt: skip
        for zone in self.zones:
            polygon = np.asarray(zone.polygon, dtype=np.float64) * scale
            inside, edge = _inside(anchors[zone.anchor], polygon)
            for k, (track, label) in enumerate(zip(ids, labels, strict=True)):
                if track < 0 or edge[k] < BAND_PX or (zone.classes and label not in zone.classes):
                    continue
                key = (zone.id, track)
                if inside[k] and key not in self.inside:
                    self.inside[key] = (t, label)
                    self.entered[zone.id][label] = self.entered[zone.id].get(label, 0) + 1
                    events.append({"type": "event", "event": "enter", "zone": zone.id, "track_id": track,
                                   "label": label, "time": t})  # fmt: skip
                elif not inside[k] and key in self.inside:
                    events.append(self._exit(zone.id, track, t))
        for track in dropped:  # a track gone is gone from its zones too
            events += [self._exit(zone, track, t) for zone, which in list(self.inside) if which == track]
            self.side = {key: side for key, side in self.side.items() if key[1] != track}
        return events

    def _exit(self, zone: str, track: int, t: float) -> dict[str, Any]:
        since, label = self.inside.pop((zone, track))
        self.exited[zone][label] = self.exited[zone].get(label, 0) + 1
        self.dwells[zone].append(t - since)
        return {"type": "event", "event": "exit", "zone": zone, "track_id": track, "label": label, "time": t,
                "dwell_s": round(t - since, 3)}  # fmt: skip

    def counts(self, now: float | None = None) -> dict[str, Any]:
        """``{"lines": {ID: {"in": {LABEL: n}, "out": {...}}}, "zones": {ID: {"occupancy", "entered", "exited",
        "dwell_s": {"p50", "max"}}}}``: dwell over the tracks that left and, up to ``now``, those inside."""
        zones = {}
        for zone in self.zones:
            here = [(since, label) for (z, _), (since, label) in self.inside.items() if z == zone.id]
            occupancy = dict(collections.Counter(label for _, label in here))
            dwells = self.dwells[zone.id] + ([now - since for since, _ in here] if now is not None else [])
            zones[zone.id] = {
                "occupancy": occupancy, "entered": dict(self.entered[zone.id]), "exited": dict(self.exited[zone.id]),
                "dwell_s": {"p50": round(float(np.median(dwells)), 3) if dwells else None,
                            "max": round(max(dwells), 3) if dwells else None},
            }  # fmt: skip
        lines = {line: {k: dict(v) for k, v in counts.items()} for line, counts in self.crossed.items()}
        return {"lines": lines, "zones": zones}


def _inside(points: np.ndarray, polygon: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Whether each of ``points`` ``[K, 2]`` is inside ``polygon`` (even-odd), and its distance to the nearest edge."""
    a, b = polygon, np.roll(polygon, -1, axis=0)
    x, y = points[:, :1], points[:, 1:]
    straddles = (a[:, 1] > y) != (b[:, 1] > y)
    with np.errstate(divide="ignore", invalid="ignore"):
        at = a[:, 0] + (y - a[:, 1]) * (b[:, 0] - a[:, 0]) / (b[:, 1] - a[:, 1])
    inside = (straddles & (x < at)).sum(axis=1) % 2 == 1
    edge = b - a
    u = np.clip(((points[:, None, :] - a) * edge).sum(axis=2) / np.maximum((edge**2).sum(axis=1), 1e-12), 0, 1)
    nearest = a + u[:, :, None] * edge
    return inside, np.hypot(*(points[:, None, :] - nearest).transpose(2, 0, 1)).min(axis=1)


def xyxy(boxes: list[list[float]], box_format: str, size: tuple[int, int], normalized: bool) -> np.ndarray:
    """Answers' boxes (``box_format``, divided by the image's ``size`` where ``normalized``) as xyxy pixels."""
    b = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    if normalized:
        b = b * np.array([*size, *size], dtype=np.float64)
    if box_format == "xywh":
        b = np.concatenate([b[:, :2], b[:, :2] + b[:, 2:]], axis=1)
    elif box_format == "cxcywh":
        b = np.concatenate([b[:, :2] - b[:, 2:] / 2, b[:, :2] + b[:, 2:] / 2], axis=1)
    return b


class TrackAsk(msgspec.Struct, frozen=True):
    """What a stream asks of tracking: the tracker's settings, its lines and zones, their coordinates' unit."""

    settings: TrackSettings
    lines: list[Line]
    zones: list[Zone]
    normalized: bool = False

    def shown(self) -> dict[str, Any]:
        return dict(msgspec.to_builtins(self))


def read_track(body: Any, before: TrackAsk | None, labels: tuple[str, ...], boxes: bool) -> TrackAsk | None:
    """A stream's tracking from ``body``'s ``track`` (true, false, or the tracker's settings), ``lines``, ``zones``
    and ``normalized`` (what it leaves out as ``before``); None: no tracking. Lines or zones track (with the
    default settings where ``track`` is not given). BadInputError names what is wrong, and tracking asked of a
    model whose answers hold no boxes (``boxes`` false)."""
    if not any(k in body for k in ("track", "lines", "zones", "normalized")):
        return before
    track = body.get("track", before.settings if before else None)
    if track is True or (track is None and (body.get("lines") or body.get("zones"))):
        track = before.settings if before else TrackSettings()
    if track is False or track is None:
        if body.get("lines") or body.get("zones"):
            raise BadInputError("lines and zones count tracks: they need track (true, or its settings)")
        return None
    if not boxes:
        raise BadInputError("tracking needs a detector (a model whose answers are boxes); this model's are not")
    try:
        settings = track if isinstance(track, TrackSettings) else msgspec.convert(track, TrackSettings)
    except msgspec.ValidationError as exc:
        raise BadInputError(f"track: {exc} (true, false, or an object of the tracker's settings)") from None
    merged = {k: body[k] for k in ("lines", "zones", "normalized") if k in body}
    if before is not None:
        merged = {"lines": before.lines, "zones": before.zones, "normalized": before.normalized, **merged}
        merged = {k: msgspec.to_builtins(v) for k, v in merged.items()}
    lines, zones, normalized = read_geometry(merged, labels)
    return TrackAsk(settings, lines, zones, normalized)


class Tracking:
    """One stream's tracks and counts, as its :class:`TrackAsk` says; :meth:`step` with each frame's answer."""

    def __init__(self, ask: TrackAsk) -> None:
        self.ask = ask
        self.tracker = ByteTrack(ask.settings)
        self.counter = Counter(ask.lines, ask.zones, ask.normalized)
        self.last_t = 0.0
        self.names: dict[int, str] = {}  # label index -> its name, as the answers say

    def change(self, ask: TrackAsk) -> None:
        """New settings keep the tracks; new lines or zones count afresh."""
        self.tracker.settings = ask.settings
        if (ask.lines, ask.zones, ask.normalized) != (self.ask.lines, self.ask.zones, self.ask.normalized):
            self.counter = Counter(ask.lines, ask.zones, ask.normalized)
        self.ask = ask

    def step(self, rows: list[dict[str, Any]], how: Any, size: tuple[int, int], t: float) -> list[dict[str, Any]]:
        """A frame's answered ``rows`` (``{"box", "label", "index", "score"}``, boxes as ``how``'s options write
        them) at ``t`` seconds: each row given its ``track_id`` (None while untracked), and the frame's events."""
        boxes = xyxy([r["box"] for r in rows], how.box_format, size, how.normalized)
        index = np.array([r["index"] for r in rows], dtype=np.int64)
        ids = self.tracker.update(boxes, np.array([r["score"] for r in rows], dtype=np.float64), index, t)
        for row, track in zip(rows, ids.tolist(), strict=True):
            row["track_id"] = track if track > 0 else None
        self.last_t = t
        self.names.update((int(r["index"]), str(r["label"])) for r in rows)
        labels = [self.names.get(k, str(k)) for k in self.tracker.labels_of(ids, index)]
        return self.counter.update(ids.tolist(), boxes, labels, t, size, self.tracker.dropped)

    def answered(
        self, answer: dict[str, Any], task: Any, options: Any, ts: Any, since: float = 0.0
    ) -> list[dict[str, Any]]:
        """A frame's answer of ``task`` (its ``options``, None: the task's default) tracked at ``ts`` seconds, or,
        where ``ts`` is not a number, now (``time.perf_counter()`` less ``since``): v2 tensors (a gRPC stream's) get
        ``TRACK_IDS`` (:meth:`tensors`), rows their ``track_id`` (:meth:`step`); the frame's events."""
        t = float(ts) if isinstance(ts, int | float) else time.perf_counter() - since
        if "outputs" in answer:
            self.tensors(answer["outputs"], t)
            return []
        rows = answer.get(task.boxes_field or "") or []
        return self.step(rows, options or task.default, (answer["width"], answer["height"]), t)

    def tensors(self, outputs: list[Any], t: float) -> None:
        """A v2 answer of one frame: its ``DETECTIONS`` ``[1, K, 6]`` (the first ``NUM_DETECTIONS``) tracked, and
        ``TRACK_IDS`` ``[1, K]`` INT32 added (-1: no track, or a padding row). A gRPC stream's answer."""
        named = {o.name: o for o in outputs}
        if "DETECTIONS" not in named:
            return
        rows = np.asarray(named["DETECTIONS"].array)[0]
        count = int(np.asarray(named["NUM_DETECTIONS"].array)[0]) if "NUM_DETECTIONS" in named else len(rows)
        ids = np.full((1, len(rows)), -1, dtype=np.int32)
        ids[0, :count] = self.tracker.update(rows[:count, :4], rows[:count, 4], rows[:count, 5], t)
        outputs.append(OutputTensor("TRACK_IDS", "INT32", [1, len(rows)], ids))

    def counts(self) -> dict[str, Any]:
        return self.counter.counts(self.last_t)
