"""``visionserve bench`` on the shipped detector, in process at the smallest sizes: the detection pipeline's figure
(decode, letterbox, forward, suppression, mapping), its suppression share, and the 1,000-candidate figures (a smoke
run that prints the share; the numbers themselves live in docs/performance.md, "Detection")."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnxruntime as ort

from service.bench.detect import THOUSAND, dense_candidates, thousand_graph
from service.bench.engine import BenchOptions, run_bench
from service.core.repository import ModelRepository

REPOSITORY = Path(__file__).parents[2] / "examples" / "model_repository"


def test_the_detection_pipeline_and_its_suppression_share() -> None:
    options = BenchOptions(
        model="digits-detect", repository=str(REPOSITORY), device="cpu", batch_sizes=(2,), seconds=0.2,
        figures=("pipeline", "candidates"),
    )  # fmt: skip
    result = run_bench(options)
    print(
        f"\npipeline {result['pipeline_images_per_s']:.1f} images/s; suppression + mapping "
        f"{100 * result['postprocess_share']:.1f}% of the forward; at 1,000 candidates "
        f"{100 * result['at_1000']['model']['postprocess_share']:.1f}% (the model's), "
        f"{100 * result['at_1000']['dense']['postprocess_share']:.1f}% (dense)"
    )
    assert result["images"].startswith("32 canvases")  # images with digits in them, so boxes are kept
    assert result["pipeline_images_per_s"] > 0
    assert result["candidates_per_image"] == 100  # the shipped graph's K
    assert 0 < result["detections_per_image"] <= result["above_threshold_per_image"] <= 100
    assert result["compute_ms_per_image"] > 0 and math.isfinite(result["postprocess_share"])
    at = result["at_1000"]
    assert at["candidates_per_image"] == THOUSAND
    assert at["model"]["detections_per_image"] > 0
    # The dense candidates are the harder case: far more of them pass the threshold than the model's do.
    assert at["dense"]["above_threshold_per_image"] > 10 * at["model"]["above_threshold_per_image"]


def test_the_thousand_candidate_graph_keeps_the_shipped_ones(tmp_path: Path) -> None:
    """The graph with K raised answers the same top 100 first (only how many leave the graph changes)."""
    version = ModelRepository(REPOSITORY).model("digits-detect").latest
    wider = thousand_graph(version.files["onnx"], tmp_path / "model.onnx")
    batch = np.random.default_rng(0).integers(0, 256, (2, 3, 96, 96), dtype=np.uint8)
    shipped = ort.InferenceSession(str(version.files["onnx"]), providers=["CPUExecutionProvider"])
    raised = ort.InferenceSession(str(wider), providers=["CPUExecutionProvider"])
    (few,) = shipped.run(None, {shipped.get_inputs()[0].name: batch})
    (many,) = raised.run(None, {raised.get_inputs()[0].name: batch})
    assert few.shape == (2, 100, 6) and many.shape == (2, THOUSAND, 6)
    np.testing.assert_allclose(many[:, :100, 4], few[:, :, 4], atol=1e-6)  # the same scores, in the same order


def test_dense_candidates_are_what_the_docstring_says() -> None:
    rows = dense_candidates(np.random.default_rng(0), 96, 10)
    assert rows.shape == (THOUSAND, 6) and rows.dtype == np.float32
    assert 150 < (rows[:, 4] >= 0.25).sum() < 350 and len(np.unique(rows[:, 5])) > 3
    assert rows[:, :4].min() >= 0 and rows[:, :4].max() <= 96
