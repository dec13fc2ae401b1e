"""The sources' store (service/frontend/sources/store.py) in one process: rows kept, changed and removed, committed
where another connection reads them, 0600, WAL with a schema version, a newer schema refused; a stored row shown
with its URL masked; a ``--sources`` row without an id gets the same id at every start."""

from __future__ import annotations

import sqlite3
import stat
from pathlib import Path

import pytest

from service.core.errors import ConfigError
from service.core.settings import ServerSettings
from service.frontend.sources.registry import file_row_id
from service.frontend.sources.store import SCHEMA_VERSION, SourceStore, document, read_rows, state_dir, store_path

URL = "rtsp://admin:hunter2@10.0.0.7:554/stream1?token=s3cret"


def test_rows_are_kept_changed_and_removed_and_read_by_another_connection(tmp_path: Path) -> None:
    path = tmp_path / "state" / "sources.db"
    store = SourceStore(path)
    store.put("door", {"url": URL, "model": "digits", "max_fps": 2})
    store.put("yard", {"url": URL, "model": "digits"})
    store.change("door", {"max_fps": 5})
    store.change("absent", {"max_fps": 5})
    assert read_rows(path) == [  # committed: another (read-only) connection sees them, in the order stored
        ("door", {"url": URL, "model": "digits", "max_fps": 5, "id": "door"}),
        ("yard", {"url": URL, "model": "digits", "id": "yard"}),
    ]
    assert store.remove("door") and not store.remove("door")
    store.put("yard", {"url": URL, "model": "digits-detect"})  # in place: one row per id
    assert [(id, body["model"]) for id, body in SourceStore(path).rows()] == [("yard", "digits-detect")]
    store.close()


def test_the_store_is_private_in_wal_mode_with_its_schema_version(tmp_path: Path) -> None:
    path = tmp_path / "state" / "sources.db"
    SourceStore(path).put("door", {"url": URL, "model": "digits"})
    for file in path.parent.iterdir():
        assert stat.S_IMODE(file.stat().st_mode) == 0o600, file
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    db.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(ConfigError, match="newer server"):
        SourceStore(path)


def test_the_state_dir_defaults_to_the_repositorys_and_no_store_reads_as_empty(tmp_path: Path) -> None:
    settings = ServerSettings(repository=str(tmp_path / "repo"))
    assert state_dir(settings) == tmp_path / "repo" / ".visionserve-state"
    assert store_path(ServerSettings(state_dir=str(tmp_path / "s"))) == tmp_path / "s" / "sources.db"
    assert read_rows(tmp_path / "none" / "sources.db") == []


def test_a_stored_row_is_shown_with_its_url_masked() -> None:
    doc = document("door", {"url": URL, "model": "digits", "max_fps": 2})
    assert doc["state"] == "restarting" and doc["max_fps"] == 2 and doc["stored"] is True
    assert "hunter2" not in doc["url"] and "s3cret" not in doc["url"]


def test_a_file_row_without_an_id_gets_the_same_id_every_time() -> None:
    row = {"url": URL, "model": "digits", "max_fps": 2}
    assert file_row_id(row) == file_row_id(dict(reversed(row.items())))
    assert file_row_id(row) != file_row_id({**row, "max_fps": 3})
