"""The sources' store (docs/sources.md, "Kept across restarts"): one SQLite database, ``sources.db`` in the state
directory, a row per source: its id and the body it was started with, changes by ``PATCH`` folded in. The owner of
the readers (``fe0``) writes it; the other front ends only read it (:func:`read_rows`). Nothing here logs a row.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from service.core.errors import ConfigError
from service.core.settings import ServerSettings
from service.frontend.sources.urls import mask

SCHEMA_VERSION = 1
FILE_NAME = "sources.db"
DEFAULT_DIR_NAME = ".visionserve-state"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS sources (
    id TEXT PRIMARY KEY,
    body TEXT NOT NULL,        -- the POST body, as JSON, with its id and every change made since
    created_s REAL NOT NULL,   -- seconds since the epoch
    changed_s REAL NOT NULL
)
"""


def state_dir(settings: ServerSettings) -> Path:
    """The state directory: ``--state-dir``, else ``.visionserve-state`` in the model repository."""
    return Path(settings.state_dir) if settings.state_dir else Path(settings.repository) / DEFAULT_DIR_NAME


def store_path(settings: ServerSettings) -> Path:
    return state_dir(settings) / FILE_NAME


class SourceStore:
    """The rows of the sources, by id, in the order they were first stored. Used by one thread (the event loop's)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            # Created 0600 before SQLite opens it; SQLite gives its -wal and -shm files the database's mode.
            os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
            os.chmod(path, 0o600)
            self._db = sqlite3.connect(path, isolation_level=None, timeout=10.0)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise ConfigError(
                    f"{path}: its schema is version {version}, this server knows up to {SCHEMA_VERSION} (a newer "
                    "server wrote it); use another --state-dir"
                )
            with self._db:
                self._db.execute("BEGIN IMMEDIATE")
                self._db.execute(_SCHEMA)
                self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except (OSError, sqlite3.Error) as exc:
            raise ConfigError(f"the sources' store {path} cannot be opened: {exc} (--state-dir)") from exc

    def rows(self) -> list[tuple[str, dict[str, Any]]]:
        """Every row: its id and its body."""
        return [(id, json.loads(body)) for id, body in self._db.execute(_ROWS)]

    def put(self, id: str, body: Mapping[str, Any]) -> None:
        """Store ``body`` as ``id``'s row (a new one, or in place of the old), committed on return."""
        now = time.time()
        text = json.dumps({**body, "id": id}, separators=(",", ":"))
        with self._db:
            self._db.execute(
                "INSERT INTO sources (id, body, created_s, changed_s) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(id) DO UPDATE SET body = excluded.body, changed_s = excluded.changed_s",
                (id, text, now, now),
            )

    def change(self, id: str, changes: Mapping[str, Any]) -> None:
        """``changes`` folded into ``id``'s row, committed on return (nothing where there is no such row)."""
        row = self._db.execute("SELECT body FROM sources WHERE id = ?", (id,)).fetchone()
        if row is not None:
            self.put(id, {**json.loads(row[0]), **changes})

    def remove(self, id: str) -> bool:
        """``id``'s row deleted, committed on return; whether there was one."""
        with self._db:
            return self._db.execute("DELETE FROM sources WHERE id = ?", (id,)).rowcount > 0

    def close(self) -> None:
        self._db.close()


_ROWS = "SELECT id, body FROM sources ORDER BY created_s, id"


def read_rows(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """Every row of the store at ``path``, read without writing (what a front end that is not the owner reads);
    none where there is no store yet."""
    if not path.exists():
        return []
    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=10.0)
        try:
            return [(id, json.loads(body)) for id, body in db.execute(_ROWS)]
        finally:
            db.close()
    except sqlite3.Error as exc:
        raise ConfigError(f"the sources' store {path} cannot be read: {exc}") from exc


def document(id: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """A stored row as a source's document, for a front end that cannot reach the owner (``fe0`` is restarting):
    state ``restarting``, its URL masked, its options as stored, no counts."""
    url = body.get("url")
    return {
        "id": id,
        "url": mask(url) if isinstance(url, str) else None,
        "model": body.get("model"),
        "state": "restarting",
        "reason": "the front end that runs the sources is starting again; this is the source as stored",
        "max_fps": body.get("max_fps", 0.0),
        "max_age_ms": body.get("max_age_ms"),
        "pace": body.get("pace", "realtime"),
        "stored": True,
    }
