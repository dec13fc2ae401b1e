"""``threads`` in config.toml reaches every CPU runtime: a setting ``tune`` chooses must not be ignored."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.core.config import ModelConfig, parse_config
from service.core.errors import ConfigError
from service.core.repository import ModelRepository
from service.runtime import OnnxRuntime, TorchScriptRuntime, make_runtime


@pytest.mark.parametrize("threads", [1, 2])
def test_onnxruntime_takes_the_configured_intra_op_threads(aoti_repo: Path, threads: int) -> None:
    version = ModelRepository(aoti_repo).model("digits").latest
    runtime = make_runtime(version, ModelConfig(threads=threads, backend="onnxruntime"), "onnxruntime", "cpu")
    try:
        assert isinstance(runtime, OnnxRuntime)
        assert runtime.session.get_session_options().intra_op_num_threads == threads
    finally:
        runtime.close()


@pytest.mark.parametrize("threads", [1, 2])
def test_torchscript_sets_its_threads_on_its_own_worker_thread(aoti_repo: Path, threads: int) -> None:
    import torch

    before = torch.get_num_threads()
    version = ModelRepository(aoti_repo).model("digits").latest
    runtime = make_runtime(version, ModelConfig(threads=threads, backend="torchscript"), "torchscript", "cpu")
    try:
        assert isinstance(runtime, TorchScriptRuntime)
        assert runtime._call(torch.get_num_threads) == threads
    finally:
        runtime.close()
    assert torch.get_num_threads() == before  # the caller's thread keeps its own


def test_zero_leaves_the_runtime_default_and_a_negative_count_is_refused(aoti_repo: Path) -> None:
    version = ModelRepository(aoti_repo).model("digits").latest
    runtime = make_runtime(version, ModelConfig(), "onnxruntime", "cpu")
    try:
        assert runtime.threads is None
    finally:
        runtime.close()
    with pytest.raises(ConfigError, match="threads"):
        parse_config({"threads": -1}, source="config.toml")
