"""The layers import in one direction: http -> batching -> runtime. Read with ast, so a wrong import fails here."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def modules(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def reaches(names: set[str], *prefixes: str) -> set[str]:
    return {n for n in names if any(n == p or n.startswith(p + ".") for p in prefixes)}


def test_runtimes_import_neither_asyncio_nor_http_nor_batching() -> None:
    for path in modules("service/runtime"):
        bad = reaches(imports(path), "asyncio", "litestar", "uvicorn", "service.http", "service.batching")
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_batching_never_imports_http() -> None:
    for path in modules("service/batching"):
        bad = reaches(imports(path), "litestar", "uvicorn", "service.http")
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_the_server_never_needs_the_model_zoo_or_export() -> None:
    """The repository on disk is the only contract: serving an artifact needs neither models/ nor export/."""
    for path in modules("service"):
        if path.name in ("cli.py", "commands.py"):  # the command line dispatches to every package, lazily
            continue
        bad = reaches(imports(path), "models", "export", "loadtest")
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_the_load_tester_talks_only_http() -> None:
    for path in modules("loadtest"):
        bad = reaches(imports(path), "service.batching", "service.runtime", "models", "export", "torch")
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"
