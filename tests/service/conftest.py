"""The trained digits model exported in all three formats, AOTInductor included: compiled once per test session
(its C++ compile is the slow part, ~14 s for smallcnn on 2 cores)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from export.exporter import ExportReport, ExportRequest, export_source
from export.sources import from_checkpoint
from tests.conftest import made_once


@pytest.fixture(scope="session")
def aoti_export(digits_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> ExportReport:
    """Made once per run of the suite (:func:`made_once`: pytest-xdist's workers share it), its report kept beside
    the repository."""

    def make(folder: Path) -> None:
        root = folder / "repo"
        source = from_checkpoint(digits_checkpoint)
        formats = ("onnx", "torchscript", "aoti")
        report = export_source(
            source, ExportRequest(name="digits", repository=str(root), formats=formats, latency=False)
        )
        (folder / "report.pickle").write_bytes(pickle.dumps(report))

    report: ExportReport = pickle.loads((made_once(tmp_path_factory, "aoti", make) / "report.pickle").read_bytes())
    return report


@pytest.fixture(scope="session")
def aoti_repo(aoti_export: ExportReport) -> Path:
    """The repository folder holding ``digits`` with model.onnx, model.pt and model.pt2."""
    assert aoti_export.ok, [a.parity.describe() for a in aoti_export.artifacts]
    return aoti_export.path.parent.parent
