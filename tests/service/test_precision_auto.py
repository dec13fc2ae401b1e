"""``precision = "auto"``: the engine serves the fastest artifact export gated for its device, and says which.

The models are the trained digits smallcnn exported here, with the speed gate forced either way
(``int8_min_speedup``), so what is asserted never depends on which precision is really faster on this machine.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from export.exporter import ExportRequest, export_model
from export.sources import from_checkpoint
from service.core.config import ModelConfig, parse_config
from service.core.errors import ConfigError
from service.core.repository import ModelRepository, ModelVersion
from service.engine.model import ModelEngine
from service.runtime import OnnxRuntime
from service.runtime.factory import int8_gated_on, make_runtime, resolve_precision
from tests.export.test_int8 import ANY_SPEED, NEVER_FAST_ENOUGH, confident_calibration

AUTO = ModelConfig(precision="auto", device="cpu", max_batch_size=8)

# name -> export settings: each a way for model.int8.onnx to be there and gated, or not.
MODELS: dict[str, dict[str, object]] = {
    "gated": {"int8": True, "int8_min_speedup": ANY_SPEED},  # both gates passed
    "absent": {},  # no model.int8.onnx
    "slower": {"int8": True, "int8_min_speedup": NEVER_FAST_ENOUGH, "int8_allow_slower": True},
    "ungated": {"int8": True, "int8_min_speedup": ANY_SPEED, "int8_ungated": True},
}


@pytest.fixture(scope="module")
def repo(digits_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> ModelRepository:
    root = tmp_path_factory.mktemp("auto-repo")
    source = from_checkpoint(digits_checkpoint)
    for name, settings in MODELS.items():
        request = ExportRequest(name=name, repository=str(root), formats=("onnx", "torchscript"), latency=False,
                                int8_method="minmax", **settings)  # type: ignore[arg-type]  # fmt: skip
        report = export_model(
            source.eager, source.spec, request, int8_data=lambda spec: confident_calibration(source.eager, spec)
        )
        assert report.ok, [a.parity.describe() for a in report.artifacts]
    return ModelRepository(root)


def _served(version: ModelVersion, config: ModelConfig = AUTO) -> tuple[str, str, str]:
    """(precision in the engine's state, its backend, the file its instance runs)."""

    async def scenario() -> tuple[str, str, str]:
        engine = ModelEngine(version, config, available_gpus=[])
        try:
            (instance,) = engine.batcher.instances
            assert isinstance(instance, OnnxRuntime)
            return engine.state().precision, engine.backend, instance.path.name
        finally:
            await engine.close()

    return asyncio.run(scenario())


def test_auto_serves_int8_where_it_passed_both_gates(repo: ModelRepository) -> None:
    version = repo.model("gated").latest
    assert int8_gated_on(version, "cpu")
    assert _served(version) == ("int8", "onnxruntime", "model.int8.onnx")


@pytest.mark.parametrize("name", ["absent", "slower", "ungated"])
def test_auto_serves_fp32_without_a_gated_int8(repo: ModelRepository, name: str) -> None:
    version = repo.model(name).latest
    assert not int8_gated_on(version, "cpu")
    assert _served(version) == ("fp32", "onnxruntime", "model.onnx")


def test_auto_takes_int8_only_on_the_device_type_it_was_timed_on(repo: ModelRepository) -> None:
    """Timed on the CPU at export: on CUDA auto does not take it, and falls to fp16 where the runtime casts (a
    TorchScript module), else to fp32 (an fp32 ONNX graph: export wrote no model.fp16.onnx)."""
    version = repo.model("gated").latest
    assert not int8_gated_on(version, "cuda:0")
    assert resolve_precision(version, AUTO, "cuda:0", "torchscript") == "fp16"
    assert resolve_precision(version, AUTO, "cuda:0", "onnxruntime") == "fp32"
    assert resolve_precision(version, AUTO, "cpu", "torchscript") == "fp32"  # int8 is onnxruntime's
    torchscript = ModelConfig(precision="auto", backend="torchscript")
    assert resolve_precision(version, torchscript, "cpu") == "fp32"  # a backend that cannot run int8 keeps fp32


def test_int8_asked_for_on_a_slower_artifact_serves_it_and_warns(
    repo: ModelRepository, caplog: pytest.LogCaptureFixture
) -> None:
    version = repo.model("slower").latest
    with caplog.at_level(logging.WARNING, logger="service.runtime.factory"):
        runtime = make_runtime(version, ModelConfig(precision="int8", device="cpu"), "onnxruntime", "cpu")
    runtime.close()
    assert "written with --int8-allow-slower" in caplog.text and "limit 0.01x" in caplog.text


def test_precision_auto_is_validated_at_config_load() -> None:
    assert parse_config({"precision": "auto"}, source="t.toml").precision == "auto"
    with pytest.raises(ConfigError, match=r"precision must be .* or auto \(the fastest gated artifact"):
        parse_config({"precision": "fastest"}, source="t.toml")
