"""The file ``visionserve classify`` and ``visionserve detect`` write: CSV or JSON Lines (by the extension), written
as answers arrive, so that an interrupted run keeps what it did and ``--resume`` can go on from there.

One :class:`Output` for both commands; what a row holds is its :class:`Table`'s: :class:`ClassifyTable` writes one
row per image (its top-k), :class:`DetectTable` one CSV row per box, and one with empty label and box for an image
with none (so that ``--resume`` knows it was done), and one JSON Lines line per image.
"""

from __future__ import annotations

import csv
import io
import os
import sys
from pathlib import Path
from typing import IO, Generic, Protocol, TypeVar

import msgspec

from service.client.kinds import DetectedImage, SegmentedImage
from service.core.answers import Detection, ImageResult, Prediction
from service.core.errors import ConfigError

FORMATS = {".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl"}
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


def csv_header(top_k: int) -> list[str]:
    ranks = [f"{name}_{r}" for r in range(1, top_k + 1) for name in ("label", "score")]
    return ["path", "model", "version", *ranks, "error"]


class ClassifyTable:
    """``path, model, version, label_1, score_1, ..., label_k, score_k, error``: one row per image."""

    counts_boxes = False

    def __init__(self, top_k: int) -> None:
        self.top_k = top_k

    def header(self) -> list[str]:
        return csv_header(self.top_k)

    def mismatch(self) -> str:
        return f"not those of --top-k {self.top_k}: resume with the --top-k it was written with"

    def csv_rows(self, path: str, result: ImageResult) -> list[list[object]]:
        preds = result.predictions if result.error is None else None
        cells: list[object] = []
        for r in range(self.top_k):
            p = preds[r] if preds and r < len(preds) else None
            cells += [p.label, f"{p.score:.6f}"] if p else ["", ""]
        return [[path, result.model or "", result.version or "", *cells, result.error or ""]]

    def json_line(self, path: str, result: ImageResult) -> bytes:
        preds = result.predictions if result.error is None else None
        row = Row(path=path, model=result.model, version=result.version, predictions=preds, error=result.error)
        return msgspec.json.encode(row)

    def csv_done(self, cells: list[str]) -> bool:
        return bool(cells[3]) and not cells[-1]

    def json_done(self, line: str) -> str | None:
        row = msgspec.json.decode(line, type=Row)
        return row.path if row.error is None and row.predictions is not None else None


class DetectTable:
    """``path, model, version, width, height, label, index, score, <box>, error``, the box's columns named for
    ``box_format`` (x1, y1, x2, y2; x, y, w, h; cx, cy, w, h): one row per box, best first; an image with no
    detections one row with its size and empty label and box; an image that failed one row with its error."""

    counts_boxes = True

    def __init__(self, box_format: str = "xyxy") -> None:
        self.box_format = box_format
        self.box = BOX_COLUMNS[box_format]

    def header(self) -> list[str]:
        return ["path", "model", "version", "width", "height", "label", "index", "score", *self.box, "error"]

    def mismatch(self) -> str:
        return f"not those of --box-format {self.box_format}: resume with the --box-format it was written with"

    def csv_rows(self, path: str, result: DetectedImage) -> list[list[object]]:
        head: list[object] = [path, result.model or "", result.version or ""]
        if result.error is not None or result.detections is None:
            return [[*head, "", "", "", "", "", *[""] * len(self.box), result.error or "no answer"]]
        size = [result.width, result.height]
        if not result.detections:
            return [[*head, *size, "", "", "", *[""] * len(self.box), ""]]
        return [
            [*head, *size, d.label, d.index, f"{d.score:.6f}", *(f"{v:.6g}" for v in d.box), ""]
            for d in result.detections
        ]

    def json_line(self, path: str, result: DetectedImage) -> bytes:
        failed = result.error is not None
        row = DetectRow(
            path=path, model=result.model, version=result.version, width=None if failed else result.width,
            height=None if failed else result.height, detections=None if failed else result.detections,
            error=result.error,
        )  # fmt: skip
        return msgspec.json.encode(row)

    def csv_done(self, cells: list[str]) -> bool:
        return bool(cells[3]) and not cells[-1]  # a size: the image was read (with or without boxes)

    def json_done(self, line: str) -> str | None:
        row = msgspec.json.decode(line, type=DetectRow)
        return row.path if row.error is None and row.detections is not None else None


class Output(Generic[R]):
    """Rows to a file (or stdout when ``path`` is None), as ``table`` lays them out. With ``resume``, the paths an
    existing file already holds a result for are in :attr:`done` and new rows are appended; its failed rows are
    dropped so those images are tried again and every path keeps its rows once."""

    def __init__(self, path: str | None, table: Table[R], *, resume: bool = False, overwrite: bool = False) -> None:
        self.path = Path(path) if path else None
        self.table: Table[R] = table
        self.format = self._format()
        self.done: set[str] = set()
        if self.path is None:
            if resume:
                raise ConfigError("--resume needs --out FILE: the results of the earlier run are read from it")
            self._file: IO[str] = sys.stdout
            self._start_csv(write_header=True)
            return
        exists = self.path.exists() and self.path.stat().st_size > 0
        if exists and not (resume or overwrite):
            raise ConfigError(
                f"{self.path} exists: pass --resume to go on from it (images it holds are skipped) or --overwrite "
                "to start again"
            )
        kept: list[str] = self._read_kept() if exists and resume else []
        if kept:
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(kept), encoding="utf-8")
            os.replace(tmp, self.path)  # a run killed here leaves the old file or the new one, never half of one
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a" if kept else "w", encoding="utf-8", newline="")
        self._start_csv(write_header=not kept)

    def _format(self) -> str:
        if self.path is None:
            return "csv"
        found = FORMATS.get(self.path.suffix.lower())
        if found is None:
            raise ConfigError(f"--out {self.path}: the extension must be one of {', '.join(FORMATS)}")
        return found

    def _start_csv(self, *, write_header: bool) -> None:
        self._csv = csv.writer(self._file, lineterminator="\n") if self.format == "csv" else None
        if self._csv is not None and write_header:
            self._csv.writerow(self.table.header())
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
        if self._csv is not None:
            buf = io.StringIO()
            csv.writer(buf, lineterminator="\n").writerows(self.table.csv_rows(path, result))
            self._file.write(buf.getvalue())
        else:
            self._file.write(self.table.json_line(path, result).decode() + "\n")

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if self._file is not sys.stdout:
            self._file.close()
        else:
            self._file.flush()
