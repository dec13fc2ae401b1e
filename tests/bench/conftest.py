"""The AOTInductor repository the engine's comparison of runtimes loads, shared with tests/service."""

from tests.service.conftest import aoti_export, aoti_repo

__all__ = ["aoti_export", "aoti_repo"]
