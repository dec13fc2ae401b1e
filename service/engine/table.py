"""The engine's model table: every model version loaded here, why the others are not, and the catalog's version.

One object, shared by the engine server, on-demand residency (:mod:`service.engine.ondemand`) and rollouts
(:mod:`service.engine.rollout`); each is handed the table, never the server. Whoever changes what the catalog
shows says so through :meth:`ModelTable.changed`, the one notification: the catalog's version moves on and the
front ends hear of it now, not at the next heartbeat.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from service.core.errors import NotFoundError
from service.core.repository import ModelEntry
from service.engine.model import ModelEngine
from service.transport.messages import VersionKey


class ModelTable:
    """Loaded versions by model (``models``), their repository entries (``configs``), load errors by model or by
    :class:`VersionKey` (``errors``), models unloaded on purpose (``unloaded``) and the catalog's ``version``."""

    def __init__(self, announce: Callable[[], None]) -> None:
        self.models: dict[str, dict[int, ModelEngine]] = {}
        self.configs: dict[str, ModelEntry] = {}
        self.errors: dict[str | VersionKey, str] = {}
        self.unloaded: dict[str, str] = {}
        self.version = 1
        self._announce = announce
        self._loop: asyncio.AbstractEventLoop | None = None

    def changed(self) -> None:
        """The catalog changed (a model loaded, left, failed, fell back, was routed elsewhere): its version moves
        on and the front ends are told at once. Called on a load's worker thread (a fallback while loading), the
        telling is handed to the event loop, the only place it may happen (before the loop made any change, none
        is told: the next heartbeat carries the version)."""
        self.version += 1
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._announce)
            return
        self._announce()

    # ---- versions ---------------------------------------------------------------------------------------------
    def versions(self, name: str) -> dict[int, ModelEngine]:
        """The loaded versions of ``name`` (empty when none)."""
        return self.models.get(name, {})

    def engine(self, name: str, version: int) -> ModelEngine:
        """The loaded ``version`` of ``name``, or 404 naming why not."""
        versions = self.models.get(name)
        if not versions:
            reason = self.errors.get(name) or self.unloaded.get(name)
            raise NotFoundError(f"unknown model {name!r}" + (f" ({reason})" if reason else ""))
        if version not in versions:
            raise NotFoundError(f"model {name!r} has no version {version} (versions: {sorted(versions)})")
        return versions[version]

    def put(self, entry: ModelEntry, versions: dict[int, ModelEngine]) -> None:
        """``entry`` loaded (``versions`` of it): in service, its old errors and unloading forgotten."""
        self.models[entry.name] = versions
        self.configs[entry.name] = entry
        self.errors.pop(entry.name, None)
        self.unloaded.pop(entry.name, None)

    def busy(self, name: str) -> bool:
        """Whether any loaded version of ``name`` has work queued or in flight."""
        engines = list(self.versions(name).values())
        return any(e.batcher.queue_depth or e.batcher.inflight_batches for e in engines)

    # ---- why not ----------------------------------------------------------------------------------------------
    def failed(self, key: str | VersionKey, reason: str) -> None:
        """A model (or one version, by its key) did not load: why."""
        self.errors[key] = reason

    def version_errors(self, name: str) -> list[str]:
        """Why versions of ``name`` did not load."""
        return [e for k, e in self.errors.items() if isinstance(k, VersionKey) and k.name == name]

    def load_error(self, name: str) -> str:
        """Why ``name`` did not load: its own error, else its versions' ("" when none)."""
        return self.errors.get(name) or "; ".join(self.version_errors(name))

    def has_errors(self, name: str) -> bool:
        return name in self.errors or bool(self.version_errors(name))

    def forget_errors(self, name: str) -> None:
        """A new load of ``name`` starts: its earlier errors go."""
        for key in [k for k in self.errors if k == name or (isinstance(k, VersionKey) and k.name == name)]:
            del self.errors[key]

    def wire_errors(self) -> dict[str, str]:
        """The errors as the catalog carries them: by model name, or ``name/version``."""
        return {str(k): v for k, v in self.errors.items()}
