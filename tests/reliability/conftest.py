"""Reliability tests: real server processes pushed past their capacity, fed hostile clients and faulty models.

Every test here prints its figures (run with ``-s`` to see them); docs/performance.md records them. The repository
is built once per session: ``digits`` (the trained smallcnn) and variants of it whose ``config.toml`` fixes their
capacity or injects a fault (``[faults]``), so each test knows what the server can do before it pushes.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import copy_model
from tests.http.conftest import RunningServer, free_port, start_server, stop_server

__all__ = ["RunningServer", "free_port", "start_server", "stop_server"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.reliability)


def add_variant(root: Path, name: str, config_toml: str) -> Path:
    """A copy of ``digits`` named ``name`` with its own config.toml."""
    target = root / name
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(root / "digits", target)
    (target / "config.toml").write_text(config_toml)
    return target


@pytest.fixture(scope="session")
def reliability_repo(digits_export: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A repository holding ``digits`` with its default config; tests add variants with :func:`add_variant` into
    copies of it (see ``repo_copy``)."""
    return copy_model(digits_export, tmp_path_factory.mktemp("reliability-repo"))


@pytest.fixture
def repo_copy(reliability_repo: Path, tmp_path: Path) -> Path:
    """A private copy of the reliability repository, for a test to add its own variants to."""
    target = tmp_path / "repo"
    shutil.copytree(reliability_repo, target)
    return target
