"""The file ``visionserve classify`` writes: CSV or JSON Lines (by the extension), one row per image, written as
answers arrive, so that an interrupted run keeps what it did and ``--resume`` can go on from there."""

from __future__ import annotations

import csv
import io
import os
import sys
from pathlib import Path
from typing import IO

import msgspec

from service.core.answers import ImageResult, Prediction
from service.core.errors import ConfigError

FORMATS = {".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl"}


class Row(msgspec.Struct, omit_defaults=False):
    """One line of a JSON Lines output."""

    path: str
    model: str | None
    version: int | None
    predictions: list[Prediction] | None
    error: str | None


def csv_header(top_k: int) -> list[str]:
    ranks = [f"{name}_{r}" for r in range(1, top_k + 1) for name in ("label", "score")]
    return ["path", "model", "version", *ranks, "error"]


class Output:
    """Rows to a file (or stdout when ``path`` is None). With ``resume``, the paths an existing file already holds
    a result for are in :attr:`done` and new rows are appended; its failed rows are dropped so those images are
    tried again and every path keeps one row."""

    def __init__(self, path: str | None, *, top_k: int, resume: bool = False, overwrite: bool = False) -> None:
        self.path = Path(path) if path else None
        self.top_k = top_k
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
            self._csv.writerow(csv_header(self.top_k))
            self._file.flush()

    def _read_kept(self) -> list[str]:
        """The lines of the existing file worth keeping (the header, and rows with predictions); fills ``done``."""
        assert self.path is not None
        text = self.path.read_text(encoding="utf-8")
        kept: list[str] = []
        if self.format == "jsonl":
            for line in text.splitlines():
                try:
                    row = msgspec.json.decode(line, type=Row)
                except msgspec.DecodeError:  # a line cut short by an interrupted run
                    continue
                if row.error is None and row.predictions is not None:
                    self.done.add(row.path)
                    kept.append(line + "\n")
            return kept
        reader = csv.reader(io.StringIO(text, newline=""))
        header = next(reader, None)
        if header != csv_header(self.top_k):
            raise ConfigError(
                f"{self.path} has the columns {header}, not those of --top-k {self.top_k}: resume with the --top-k "
                "it was written with, or write to another file"
            )
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(header)
        for cells in reader:
            if len(cells) == len(header) and cells[3] and not cells[-1]:
                self.done.add(cells[0])
                writer.writerow(cells)
        return [buf.getvalue()]

    def write(self, path: str, result: ImageResult) -> None:
        preds = result.predictions if result.error is None else None
        if self._csv is not None:
            cells: list[object] = []
            for r in range(self.top_k):
                p = preds[r] if preds and r < len(preds) else None
                cells += [p.label, f"{p.score:.6f}"] if p else ["", ""]
            self._csv.writerow([path, result.model or "", result.version or "", *cells, result.error or ""])
        else:
            row = Row(path=path, model=result.model, version=result.version, predictions=preds, error=result.error)
            self._file.write(msgspec.json.encode(row).decode() + "\n")

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if self._file is not sys.stdout:
            self._file.close()
        else:
            self._file.flush()
