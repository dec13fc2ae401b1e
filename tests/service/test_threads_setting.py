"""``threads`` and ``intra_op_spinning`` in config.toml reach the CPU runtimes: settings that ``tune`` and users
choose must not be ignored."""

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


@pytest.mark.parametrize(("spinning", "entry"), [(True, "1"), (False, "0")])
def test_onnxruntime_takes_the_configured_spinning(aoti_repo: Path, spinning: bool, entry: str) -> None:
    version = ModelRepository(aoti_repo).model("digits").latest
    config = ModelConfig(intra_op_spinning=spinning, backend="onnxruntime")
    runtime = make_runtime(version, config, "onnxruntime", "cpu")
    try:
        assert isinstance(runtime, OnnxRuntime)
        options = runtime.session.get_session_options()
        assert options.get_session_config_entry("session.intra_op.allow_spinning") == entry
    finally:
        runtime.close()


@pytest.mark.parametrize(("setting", "option"), [("heuristic", "HEURISTIC"), ("exhaustive", "EXHAUSTIVE")])
def test_the_cuda_providers_convolution_search_comes_from_the_config(
    aoti_repo: Path, setting: str, option: str
) -> None:
    """onnxruntime's CUDA provider defaults to an exhaustive search per new input shape, paid while serving by each
    batch size warm-up did not see: the config's setting (heuristic by default) is what the provider is given. The
    session is built on the CPU here; the CUDA options are what it would be handed."""
    version = ModelRepository(aoti_repo).model("digits").latest
    assert ModelConfig().conv_algo_search == "heuristic"
    runtime = make_runtime(version, ModelConfig(conv_algo_search=setting), "onnxruntime", "cpu")  # type: ignore[arg-type]
    try:
        assert isinstance(runtime, OnnxRuntime)
        runtime.device = "cuda:1"  # what the options say for a GPU instance
        assert runtime.cuda_options() == {"device_id": 1, "cudnn_conv_algo_search": option}
    finally:
        runtime.device = "cpu"
        runtime.close()
    with pytest.raises(ConfigError, match="conv_algo_search must be heuristic, exhaustive or default"):
        parse_config({"conv_algo_search": "fastest"}, source="config.toml")
