"""A repository folder laid out as KServe's storage initializer leaves it: one model's files directly in the folder
(``/mnt/models/1/model.onnx``, ``/mnt/models/config.toml``), the model's name given from outside."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from export.exporter import ExportRequest, export_model
from export.sources import from_architecture
from service.core.errors import ConfigError, NotFoundError
from service.core.repository import MODEL_NAME_ENV, ModelRepository


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    source = from_architecture("smallcnn")
    export_model(
        source.eager, source.spec, ExportRequest(name="good", repository=str(root), formats=("onnx",), latency=False)
    )
    (root / "good" / "config.toml").write_text("max_batch_size = 4\n")
    return root / "good"


@pytest.fixture
def mnt_models(exported: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The model's own folder under another name, as ``/mnt/models`` is."""
    monkeypatch.delenv(MODEL_NAME_ENV, raising=False)
    root = tmp_path / "models"
    shutil.copytree(exported, root)
    return root


def test_a_named_model_folder_is_read_as_that_one_model(mnt_models: Path) -> None:
    repo = ModelRepository(mnt_models, model_name="digits")
    index = repo.scan()
    assert list(index.models) == ["digits"] and not index.errors
    entry = index.models["digits"]
    assert entry.path == mnt_models and list(entry.versions) == [1]
    assert entry.latest.model == "digits" and entry.config.max_batch_size == 4  # config.toml beside the versions
    assert repo.model("digits").name == "digits"
    assert repo.next_version("digits") == 2
    with pytest.raises(NotFoundError):
        repo.model("good")  # the folder's old name is not a model here


def test_the_name_comes_from_the_environment_when_not_given(mnt_models: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MODEL_NAME_ENV, "mnist")
    assert list(ModelRepository(mnt_models).scan().models) == ["mnist"]
    assert list(ModelRepository(mnt_models, model_name="digits").scan().models) == ["digits"]  # given wins


def test_version_folders_without_a_name_are_refused_with_what_to_do(mnt_models: Path) -> None:
    with pytest.raises(ConfigError, match=f"version folders \\(1/\\).*{MODEL_NAME_ENV}"):
        ModelRepository(mnt_models).scan()


@pytest.mark.parametrize("bad", [".hidden", "a/b"])
def test_a_name_that_is_not_a_plain_name_is_refused(mnt_models: Path, bad: str) -> None:
    with pytest.raises(ConfigError, match="plain name"):
        ModelRepository(mnt_models, model_name=bad)


def test_a_repository_of_models_reads_as_before(mnt_models: Path, tmp_path: Path) -> None:
    root = tmp_path / "repository"
    shutil.copytree(mnt_models, root / "digits")
    assert list(ModelRepository(root).scan().models) == ["digits"]
