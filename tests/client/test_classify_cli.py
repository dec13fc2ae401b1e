"""``visionserve classify`` through a real server and in-process: rows, exit codes, resume, the summary."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from service.cli import main
from service.inprocess import InProcessServer


def rows_of(path: Path) -> dict[str, dict[str, str]]:
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    by_path = {row["path"]: row for row in rows}
    assert len(by_path) == len(rows), "one row per image"
    return by_path


def test_a_folder_through_the_server_then_resumed(
    client_server: InProcessServer,
    digit_folder: tuple[Path, dict[str, int]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    shared, shared_labels = digit_folder
    folder = tmp_path / "images"  # a copy, since this test mends the corrupt file
    shutil.copytree(shared, folder)
    labels = {str(folder / Path(p).relative_to(shared)): label for p, label in shared_labels.items()}
    out = tmp_path / "preds.csv"
    args = ["classify", "--url", client_server.url, "--model", "digits", str(folder), "--out", str(out),
            "--top-k", "3", "--images-per-request", "6", "--concurrency", "3", "--no-progress"]  # fmt: skip
    assert main(args) == 1  # the corrupt file failed
    rows = rows_of(out)
    assert set(rows) == set(labels)  # every image by content (an extension-less one too), no text file
    corrupt = next(p for p, label in labels.items() if label < 0)
    reason = rows[corrupt]["error"].split(":")[0]
    assert reason and rows[corrupt]["label_1"] == ""
    good = {p: row for p, row in rows.items() if p != corrupt}
    assert all(row["error"] == "" and row["model"] == "digits" and row["version"] == "1" for row in good.values())
    assert all(float(row["score_1"]) >= float(row["score_2"]) >= float(row["score_3"]) for row in good.values())
    hits = sum(row["label_1"] == str(labels[p]) for p, row in good.items())
    assert hits >= 7, rows  # of 11 real digits; chance is about 1
    summary = capsys.readouterr().err
    assert "11 ok, 1 failed" in summary and "2 files passed over" in summary, summary
    assert f"failures by reason:\n       1  {reason}\n" in summary, summary
    assert "p50" in summary and "p99" in summary

    assert main(args) == 2  # the file exists: neither --resume nor --overwrite
    capsys.readouterr()

    # Mend the corrupt file and go on: only it is sent again, and it replaces its failed row.
    Path(corrupt).write_bytes(Path(next(iter(good))).read_bytes())
    assert main([*args, "--resume"]) == 0
    summary = capsys.readouterr().err
    assert "classified 1 images" in summary and "1 ok, 0 failed; 11 skipped" in summary, summary
    again = rows_of(out)
    assert set(again) == set(labels) and all(row["error"] == "" for row in again.values())
    assert {p: again[p] for p in good} == good  # the earlier rows are kept as they were


def test_in_process_gives_the_servers_answers(
    client_server: InProcessServer,
    client_repo: Path,
    digit_folder: tuple[Path, dict[str, int]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    folder, labels = digit_folder
    served, local = tmp_path / "served.jsonl", tmp_path / "local.jsonl"
    common = ["classify", "--model", "digits", str(folder), "--top-k", "2", "--no-progress"]
    assert main([*common, "--url", client_server.url, "--out", str(served)]) == 1
    assert main([*common, "--repository", str(client_repo), "--device", "cpu", "--out", str(local)]) == 1
    capsys.readouterr()

    def read(path: Path) -> dict[str, dict[str, object]]:
        return {row["path"]: row for row in map(json.loads, path.read_text().splitlines())}

    a, b = read(served), read(local)
    assert set(a) == set(b) == set(labels)
    for path in labels:
        if labels[path] < 0:
            assert a[path]["error"] and b[path]["error"] and a[path]["predictions"] is None
            continue
        pa, pb = a[path]["predictions"], b[path]["predictions"]
        assert isinstance(pa, list) and isinstance(pb, list) and len(pa) == len(pb) == 2
        assert [p["label"] for p in pa] == [p["label"] for p in pb]
        assert pa[0]["score"] == pytest.approx(pb[0]["score"], abs=1e-5)
        assert b[path]["model"] == "digits" and b[path]["version"] == 1


def test_an_unknown_model_stops_the_run(
    client_server: InProcessServer, digit_folder: tuple[Path, dict[str, int]], capsys: pytest.CaptureFixture[str]
) -> None:
    folder, _ = digit_folder
    assert main(["classify", "--url", client_server.url, "--model", "nope", str(folder), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "404" in err and "nope" in err


def test_nothing_to_classify_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "readme.txt").write_text("no images here")
    assert main(["classify", "--model", "digits", str(tmp_path), "--no-progress"]) == 2
    assert main(["classify", "--model", "digits", str(tmp_path / "missing"), "--no-progress"]) == 2
    assert "no image files" in capsys.readouterr().err
