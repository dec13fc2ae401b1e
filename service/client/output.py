"""The file ``visionserve classify`` and ``visionserve detect`` write: CSV or JSON Lines (by the extension), written
as answers arrive, so that an interrupted run keeps what it did and ``--resume`` can go on from there.

One :class:`Output` for every command; what a row holds is its :class:`Table`'s: :class:`ClassifyTable` writes one
row per image (its top-k), :class:`DetectTable` one CSV row per box, and one with empty label and box for an image
with none (so that ``--resume`` knows it was done), and one JSON Lines line per image; :class:`SegmentTable` a
detection's rows with each instance's area (masks in JSON Lines), and COCO's results JSON for ``.json``
(:class:`CocoResults`, written at the end: what ``COCO.loadRes`` reads).
"""

from __future__ import annotations

import csv
import io
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, Generic, Protocol, TypeVar

import msgspec
import numpy as np

from service.client.kinds import DetectedImage, SegmentedImage
from service.core.answers import Detection, ImageResult, Prediction
from service.core.errors import ConfigError
from service.core.tasks.segment import Instance

FORMATS = {".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "coco"}
BOX_COLUMNS = {"xyxy": ("x1", "y1", "x2", "y2"), "xywh": ("x", "y", "w", "h"), "cxcywh": ("cx", "cy", "w", "h")}
R_contra = TypeVar("R_contra", contravariant=True)
R = TypeVar("R", ImageResult, DetectedImage, SegmentedImage)


class Row(msgspec.Struct, omit_defaults=False):
    """One line of a classification's JSON Lines output."""

    path: str
    model: str | None
    version: int | None
    predictions: list[Prediction] | None
    error: str | None


class DetectRow(msgspec.Struct, omit_defaults=False):
    """One line of a detection's JSON Lines output: one image, its size and its detections, or its error."""

    path: str
    model: str | None
    version: int | None
    width: int | None
    height: int | None
    detections: list[Detection] | None
    error: str | None


class Table(Protocol[R_contra]):
    """What one command's rows hold: the CSV header, an image's CSV rows and JSON line, and which lines of an
    earlier run hold a result (kept on ``--resume``; an error's line is dropped so that its image is tried again)."""

    counts_boxes: bool  # the summary counts boxes

    def header(self) -> list[str]: ...
    def mismatch(self) -> str: ...
    def csv_rows(self, path: str, result: R_contra) -> list[list[object]]: ...
    def json_line(self, path: str, result: R_contra) -> bytes: ...
    def csv_done(self, cells: list[str]) -> bool: ...
    def json_done(self, line: str) -> str | None: ...


class _Rows:
    """What every table shares: an image's JSON line is its :attr:`row`, whose fields between ``version`` and
    ``error`` are the result's own (none for a failed image); a CSV row's fourth cell (a label or a size) says the
    image was read (with or without boxes), an empty last cell that it did not fail."""

    row: Any

    def json_line(self, path: str, result: Any) -> bytes:
        fields = {f: getattr(result, f) if result.error is None else None for f in self.row.__struct_fields__[3:-1]}
        return msgspec.json.encode(
            self.row(path=path, model=result.model, version=result.version, error=result.error, **fields)
        )

    def csv_done(self, cells: list[str]) -> bool:
        return bool(cells[3]) and not cells[-1]

    def json_done(self, line: str) -> str | None:
        row = msgspec.json.decode(line, type=self.row)
        return row.path if row.error is None and getattr(row, self.row.__struct_fields__[-2]) is not None else None


class ClassifyTable(_Rows):
    """``path, model, version, label_1, score_1, ..., label_k, score_k, error``: one row per image."""

    counts_boxes = False
    row = Row

    def __init__(self, top_k: int) -> None:
        self.top_k = top_k

    def header(self) -> list[str]:
        ranks = [f"{name}_{r}" for r in range(1, self.top_k + 1) for name in ("label", "score")]
        return ["path", "model", "version", *ranks, "error"]

    def mismatch(self) -> str:
        return f"not those of --top-k {self.top_k}: resume with the --top-k it was written with"

    def csv_rows(self, path: str, result: ImageResult) -> list[list[object]]:
        preds = result.predictions if result.error is None else None
        cells: list[object] = []
        for r in range(self.top_k):
            p = preds[r] if preds and r < len(preds) else None
            cells += [p.label, f"{p.score:.6f}"] if p else ["", ""]
        return [[path, result.model or "", result.version or "", *cells, result.error or ""]]


class DetectTable(_Rows):
    """``path, model, version, width, height, label, index, score, <box>, error``, the box's columns named for
    ``box_format`` (x1, y1, x2, y2; x, y, w, h; cx, cy, w, h): one row per box, best first; an image with no
    detections one row with its size and empty label and box; an image that failed one row with its error."""

    counts_boxes = True
    row: Any = DetectRow

    def __init__(self, box_format: str = "xyxy") -> None:
        self.box_format = box_format
        self.box = BOX_COLUMNS[box_format]

    def header(self) -> list[str]:
        return ["path", "model", "version", "width", "height", "label", "index", "score", *self.box, "error"]

    def mismatch(self) -> str:
        return f"not those of --box-format {self.box_format}: resume with the --box-format it was written with"

    def csv_rows(self, path: str, result: DetectedImage | SegmentedImage) -> list[list[object]]:
        head: list[object] = [path, result.model or "", result.version or ""]
        boxes = result.detections if isinstance(result, DetectedImage) else result.instances
        if result.error is not None or boxes is None:
            return [[*head, "", "", "", "", "", *[""] * len(self.box), result.error or "no answer"]]
        size = [result.width, result.height]
        if not boxes:
            return [[*head, *size, "", "", "", *[""] * len(self.box), ""]]
        return [[*head, *size, d.label, d.index, f"{d.score:.6f}", *(f"{v:.6g}" for v in d.box), ""] for d in boxes]


class SegmentRow(msgspec.Struct, omit_defaults=False):
    """One line of a segmentation's JSON Lines output: one image, its size and its instances (masks included)."""

    path: str
    model: str | None
    version: int | None
    width: int | None
    height: int | None
    instances: list[Instance] | None
    error: str | None


class SegmentTable(DetectTable):
    """A detection's CSV rows with each instance's ``area`` before ``error`` (masks do not fit a cell: JSON Lines
    or COCO's JSON hold them); JSON Lines: one line per image with its instances; ``.json``: COCO's results."""

    row = SegmentRow

    def header(self) -> list[str]:
        return [*super().header()[:-1], "area", "error"]

    def csv_rows(self, path: str, result: SegmentedImage) -> list[list[object]]:  # type: ignore[override]
        rows = super().csv_rows(path, result)
        areas: list[object] = [i.area for i in result.instances or []] or [""]
        return [[*row[:-1], area, row[-1]] for row, area in zip(rows, areas, strict=False)]


class CocoResults:
    """COCO's results JSON of a segmenter's answers (``[{"image_id", "category_id", "segmentation", "bbox",
    "score"}]``, the masks compressed RLE, the boxes x, y, w, h), what ``COCO.loadRes`` reads. Ids from
    ``annotations`` (a COCO annotations file: images by ``file_name``, categories by ``name``) where given; else an
    image's id is its file's stem where that is a number (COCO's ``000000139.jpg`` is 139), or its place in
    ``paths`` (from 1), and a category's id is the model's class index."""

    def __init__(self, paths: list[str], annotations: str | None = None) -> None:
        self.images: dict[str, int] = {}
        self.categories: dict[str, int] | None = None
        if annotations:
            try:
                known = msgspec.json.decode(Path(annotations).read_bytes())
                by_name = {str(i["file_name"]): int(i["id"]) for i in known["images"]}
                self.categories = {str(c["name"]): int(c["id"]) for c in known["categories"]}
            except (OSError, msgspec.DecodeError, KeyError, TypeError, ValueError) as exc:
                raise ConfigError(f"--annotations {annotations}: not a COCO annotations file ({exc})") from None
            self.images = {p: by_name[Path(p).name] for p in paths if Path(p).name in by_name}
        else:
            for n, p in enumerate(paths, start=1):
                stem = Path(p).stem
                self.images[p] = int(stem) if stem.isdigit() else n
        self.items: list[dict[str, object]] = []

    def add(self, path: str, result: SegmentedImage) -> None:
        image = self.images.get(path)
        for i in result.instances or [] if image is not None else []:
            category = i.index if self.categories is None else self.categories.get(i.label)
            if category is None:
                continue  # a class the annotations do not name
            x1, y1, x2, y2 = i.box
            self.items.append({"image_id": image, "category_id": category, "segmentation": i.mask,
                               "bbox": [x1, y1, x2 - x1, y2 - y1], "score": i.score})  # fmt: skip


def overlay(path: str, result: SegmentedImage, folder: Path) -> None:
    """The image with each instance's mask filled translucently (a colour a class), its box and label drawn, as
    ``folder``/<file's stem>.png."""
    from PIL import Image, ImageDraw, ImageOps

    from service.core.masks import decoded

    with Image.open(path) as opened:
        image = ImageOps.exif_transpose(opened).convert("RGB")
    pixels = np.asarray(image, dtype=np.float32)
    for i in result.instances or []:
        colour = np.array(PALETTE[i.index % len(PALETTE)], dtype=np.float32)
        inside = decoded(i.mask) if isinstance(i.mask, dict) else np.zeros(pixels.shape[:2], dtype=bool)
        if inside.shape == pixels.shape[:2]:
            pixels[inside] = 0.5 * pixels[inside] + 0.5 * colour
    drawn = Image.fromarray(pixels.round().astype(np.uint8))
    pen = ImageDraw.Draw(drawn)
    for i in result.instances or []:
        pen.rectangle(i.box, outline=PALETTE[i.index % len(PALETTE)], width=2)
        pen.text((i.box[0] + 2, i.box[1] + 1), f"{i.label} {i.score:.2f}", fill=(255, 255, 255))
    folder.mkdir(parents=True, exist_ok=True)
    drawn.save(folder / f"{Path(path).stem}.png")


PALETTE = [(230, 25, 75), (60, 180, 75), (255, 225, 25), (0, 130, 200), (245, 130, 48), (145, 30, 180),
           (70, 240, 240), (240, 50, 230), (210, 245, 60), (250, 190, 212)]  # fmt: skip


class Output(Generic[R]):
    """Rows to a file (or stdout when ``path`` is None), as ``table`` lays them out. With ``resume``, the paths an
    existing file already holds a result for are in :attr:`done` and new rows are appended; its failed rows are
    dropped so those images are tried again and every path keeps its rows once."""

    def __init__(
        self,
        path: str | None,
        table: Table[R],
        *,
        resume: bool = False,
        overwrite: bool = False,
        coco: CocoResults | None = None,
        each: Callable[[str, R], None] | None = None,
    ) -> None:
        self.path = Path(path) if path else None
        self.table: Table[R] = table
        found = FORMATS.get(self.path.suffix.lower()) if self.path else "csv"
        if found is None:
            raise ConfigError(f"--out {self.path}: the extension must be one of {', '.join(FORMATS)}")
        self.format = found
        self.done: set[str] = set()
        self.each: Callable[[str, R], None] | None = each  # every result, as written (segment --overlays)
        self.coco = coco if self.format == "coco" else None
        exists = self.path is not None and self.path.exists() and self.path.stat().st_size > 0
        kept: list[str] = []
        if self.format == "coco":
            if coco is None:
                raise ConfigError(f"--out {self.path}: COCO's results JSON is for segmenters (segment --out F.json)")
            if resume:
                raise ConfigError("--resume goes on from a .csv or .jsonl --out; COCO's JSON is written at the end")
            if exists and not overwrite:
                raise ConfigError(f"{self.path} exists: pass --overwrite to replace it, or name another file")
            self._file: IO[str] = io.StringIO()
        elif self.path is None:
            if resume:
                raise ConfigError("--resume needs --out FILE: the results of the earlier run are read from it")
            self._file = sys.stdout
        else:
            if exists and not (resume or overwrite):
                raise ConfigError(
                    f"{self.path} exists: pass --resume to go on from it (images it holds are skipped) or --overwrite "
                    "to start again"
                )
            kept = self._read_kept() if exists and resume else []
            if kept:
                tmp = self.path.with_name(self.path.name + ".tmp")
                tmp.write_text("".join(kept), encoding="utf-8")
                os.replace(tmp, self.path)  # a run killed here leaves the old file or the new one, never half of one
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a" if kept else "w", encoding="utf-8", newline="")
        if self.format == "csv" and not kept:
            csv.writer(self._file, lineterminator="\n").writerow(self.table.header())
            self._file.flush()

    def _read_kept(self) -> list[str]:
        """The lines of the existing file worth keeping (the header, and rows with results); fills ``done``."""
        assert self.path is not None
        text = self.path.read_text(encoding="utf-8")
        kept: list[str] = []
        if self.format == "jsonl":
            for line in text.splitlines():
                try:
                    done = self.table.json_done(line)
                except msgspec.DecodeError:  # a line cut short by an interrupted run
                    continue
                if done is not None:
                    self.done.add(done)
                    kept.append(line + "\n")
            return kept
        reader = csv.reader(io.StringIO(text, newline=""))
        header = next(reader, None)
        if header is None or header != self.table.header():
            raise ConfigError(
                f"{self.path} has the columns {header}, {self.table.mismatch()}, or write to another file"
            )
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(header)
        for cells in reader:
            if len(cells) == len(header) and self.table.csv_done(cells):
                self.done.add(cells[0])
                writer.writerow(cells)
        return [buf.getvalue()]

    def write(self, path: str, result: R) -> None:
        """``result``'s rows; an image's rows go in one write (an interrupted run cuts between images)."""
        if self.each is not None:
            self.each(path, result)
        if self.coco is not None:
            self.coco.add(path, result)  # type: ignore[arg-type]
        elif self.format == "csv":
            buf = io.StringIO()
            csv.writer(buf, lineterminator="\n").writerows(self.table.csv_rows(path, result))
            self._file.write(buf.getvalue())
        else:
            self._file.write(self.table.json_line(path, result).decode() + "\n")

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if self.coco is not None and self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_bytes(msgspec.json.encode(self.coco.items))
            os.replace(tmp, self.path)
        if self._file is not sys.stdout:
            self._file.close()
        else:
            self._file.flush()
