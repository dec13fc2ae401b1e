"""The repository reader's refusals: each names the file, the field and the value; a broken model never stops
the others from loading."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from export.exporter import ExportRequest, export_model
from export.sources import from_architecture
from service.core.config import load_config, parse_config
from service.core.errors import ConfigError, NotFoundError
from service.core.repository import ModelRepository


@pytest.fixture(scope="module")
def good_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    source = from_architecture("smallcnn")
    export_model(source.eager, source.spec, ExportRequest(name="good", repository=str(root), latency=False))
    return root


@pytest.fixture
def repo(good_repo: Path, tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    shutil.copytree(good_repo, root)
    return root


def _broken(repo: Path) -> Path:
    """A second model, 'bad', to be broken by each test; 'good' must keep loading."""
    shutil.copytree(repo / "good", repo / "bad")
    return repo / "bad"


def _refusal(repo: Path) -> str:
    index = ModelRepository(repo).scan()
    assert "good" in index.models, index.errors  # a broken model never stops the others
    assert "bad" not in index.models
    return index.errors["bad"]


def test_a_good_repository_lists_models_and_versions(repo: Path) -> None:
    index = ModelRepository(repo).scan()
    assert list(index.models) == ["good"] and not index.errors
    entry = index.models["good"]
    assert list(entry.versions) == [1] and entry.latest.spec.architecture == "smallcnn"
    assert entry.config == load_config(repo / "good" / "config.toml")


def test_missing_spec_is_refused(repo: Path) -> None:
    (_broken(repo) / "1" / "spec.json").unlink()
    assert "spec.json is missing" in _refusal(repo)


def test_missing_model_files_are_refused(repo: Path) -> None:
    bad = _broken(repo)
    (bad / "1" / "model.onnx").unlink()
    (bad / "1" / "model.pt").unlink()
    assert "holds no model file" in _refusal(repo)


@pytest.mark.parametrize("name", ["model.onnx", "model.pt"])
def test_truncated_model_file_is_refused(repo: Path, name: str) -> None:
    """The artifact the model serves from (a TorchScript file alone; beside an ONNX one it is a spare, set aside:
    the test below)."""
    path = _broken(repo) / "1" / name
    if name == "model.pt":
        (path.parent / "model.onnx").unlink()
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    message = _refusal(repo)
    assert name in message and ("truncated" in message or "corrupt" in message)


def test_label_count_not_matching_the_output_width_is_refused(repo: Path) -> None:
    bad = _broken(repo)
    spec_path = bad / "1" / "spec.json"
    spec = json.loads(spec_path.read_text())
    spec["labels"] = spec["labels"][:7]
    spec_path.write_text(json.dumps(spec))
    message = _refusal(repo)
    assert "7 classes" in message and "10 logits" in message


def test_label_count_mismatch_is_caught_for_torchscript_too(repo: Path) -> None:
    bad = _broken(repo)
    (bad / "1" / "model.onnx").unlink()
    spec_path = bad / "1" / "spec.json"
    spec = json.loads(spec_path.read_text())
    spec["labels"] = [*spec["labels"], "extra"]
    spec_path.write_text(json.dumps(spec))
    message = _refusal(repo)
    assert "11 classes" in message and "model.pt outputs 10 logits" in message


def test_spec_breaking_its_schema_names_the_field(repo: Path) -> None:
    spec_path = _broken(repo) / "1" / "spec.json"
    spec = json.loads(spec_path.read_text())
    spec["input"]["height"] = 0
    spec_path.write_text(json.dumps(spec))
    message = _refusal(repo)
    assert "spec.json" in message and "$.input.height" in message


def test_unknown_config_key_is_refused(repo: Path) -> None:
    (_broken(repo) / "config.toml").write_text("max_batch_sise = 8\n")
    message = _refusal(repo)
    assert "unknown setting 'max_batch_sise' = 8" in message and "bad/config.toml" in message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("max_batch_size = 0", "max_batch_size must be an integer >= 1, got 0"),
        ('max_batch_size = "big"', "max_batch_size must be an integer >= 1, got 'big'"),
        ('backend = "tensorrt"', "backend must be auto, onnxruntime, torchscript or aoti, got 'tensorrt'"),
        ("queue_full_status = 500", "queue_full_status must be 503 or 429, got 500"),
        ('batch_policy = "eager"', "batch_policy must be delay or adaptive, got 'eager'"),
        ('device = "gpu0"', "device must be auto, cpu, cuda or cuda:N, got 'gpu0'"),
        ("max_queue_delay_ms = -1", "max_queue_delay_ms must be a number >= 0, got -1"),
        ("preferred_batch_sizes = [4, 64]", "preferred_batch_sizes entries must be between 1 and max_batch_size"),
        ("max_batch_size = [", "not valid TOML"),
    ],
)
def test_bad_config_values_name_file_field_and_value(repo: Path, text: str, expected: str) -> None:
    (_broken(repo) / "config.toml").write_text(text + "\n")
    message = _refusal(repo)
    assert expected in message and "bad/config.toml" in message


def test_bad_version_folder_is_refused_but_good_versions_serve(repo: Path) -> None:
    shutil.copytree(repo / "good" / "1", repo / "good" / "2")
    (repo / "good" / "2" / "model.onnx").write_bytes(b"not onnx")
    entry = ModelRepository(repo).scan().models["good"]
    assert list(entry.versions) == [1] and "model.onnx" in entry.version_errors[2]
    with pytest.raises(NotFoundError, match="no usable version 2"):
        entry.version(2)


def test_config_defaults_and_parse() -> None:
    config = parse_config({"max_batch_size": 8, "preferred_batch_sizes": [4, 8]}, source="x")
    assert config.max_batch_size == 8 and config.preferred_batch_sizes == (4, 8)
    assert config.max_queue_delay_ms == 2.0 and config.backend == "auto"


def test_missing_repository_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        ModelRepository(tmp_path / "nope").scan()
    with pytest.raises(NotFoundError):
        ModelRepository(tmp_path).model("nope")


def test_a_broken_spare_beside_the_onnx_model_is_set_aside_and_the_onnx_one_serves(repo: Path) -> None:
    (repo / "good" / "1" / "model.pt").write_bytes(b"PK\x03\x04 not a TorchScript archive")
    version = ModelRepository(repo).model("good").latest
    assert set(version.files) == {"onnx"}  # model.pt set aside: the version still serves from model.onnx
    (repo / "good" / "config.toml").write_text('backend = "torchscript"\n')
    with pytest.raises(ConfigError, match=r"model\.pt"):  # asked for by name: its failure is the version's
        ModelRepository(repo).model("good")


def test_reading_a_repository_whose_onnx_model_serves_never_imports_torch(repo: Path) -> None:
    """The TorchScript file beside it is checked as an archive, not loaded: a serving host needs no torch."""
    import subprocess
    import sys

    code = (
        "import sys; from service.core.repository import ModelRepository; "
        f"v = ModelRepository({str(repo)!r}).model('good').latest; "
        "print(sorted(v.files), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("] ")[-1].strip() == "False", out.stdout
    assert "'torchscript'" in out.stdout  # the good spare is kept, unloaded
