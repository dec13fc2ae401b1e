"""The trained digits model exported in all three formats, AOTInductor included: compiled once per test session
(its C++ compile is the slow part, ~14 s for smallcnn on 2 cores)."""

from __future__ import annotations

from pathlib import Path

import pytest

from export.exporter import ExportReport, ExportRequest, export_source
from export.sources import from_checkpoint


@pytest.fixture(scope="session")
def aoti_export(digits_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> ExportReport:
    root = tmp_path_factory.mktemp("aoti-repo")
    source = from_checkpoint(digits_checkpoint)
    request = ExportRequest(name="digits", repository=str(root), formats=("onnx", "torchscript", "aoti"), latency=False)
    return export_source(source, request)


@pytest.fixture(scope="session")
def aoti_repo(aoti_export: ExportReport) -> Path:
    """The repository folder holding ``digits`` with model.onnx, model.pt and model.pt2."""
    assert aoti_export.ok, [a.parity.describe() for a in aoti_export.artifacts]
    return aoti_export.path.parent.parent
