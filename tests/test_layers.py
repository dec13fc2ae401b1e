"""The rooms import in one direction (DESIGN.md, "Processes, and the rooms they live in"). Read with ast, so a
wrong import fails here, not in review.

    frontend -> transport -> core          engine -> transport, runtime -> core
    supervisor, cli, commands, tune, bench: on top of everything (tune and bench drive runtimes, the engine, the load
    tester and `serve`)
    models -> core;  export -> core, runtime;  loadtest -> core at most
    client -> core (and runtime, in its in-process module alone)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ROOMS = ("service.frontend", "service.engine", "service.transport", "service.runtime", "service.core", "service.client")
TOP = (
    "service.supervisor",
    "service.cli",
    "service.commands",
    "service.tune",
    "service.bench",
    "service.inprocess",
    "service.launcher",
)

# room -> the service rooms it may import (besides itself)
ALLOWED = {
    "service/core": (),
    "service/runtime": ("service.core",),
    "service/transport": ("service.core",),
    "service/engine": ("service.transport", "service.runtime", "service.core"),
    "service/frontend": ("service.transport", "service.core"),
    "models": ("service.core",),
    "export": ("service.core", "service.runtime"),
    "loadtest": ("service.core",),
    # The client speaks HTTP to a server and never reaches into one; its in-process mode (`visionserve classify`
    # without --url) starts one in its process, from the top (service.inprocess; see the test below).
    "service/client": ("service.core", "service.inprocess"),
}


def imports(path: Path, *, top_level_only: bool = False) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def modules(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def reaches(names: set[str], *prefixes: str) -> set[str]:
    return {n for n in names if any(n == p or n.startswith(p + ".") for p in prefixes)}


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_each_room_imports_only_the_rooms_below_it(room: str) -> None:
    own = room.replace("/", ".")
    forbidden = [r for r in (*ROOMS, *TOP) if r not in ALLOWED[room] and r != own]
    if room in ("models", "export", "loadtest"):
        forbidden = [*forbidden, "service.frontend", "service.engine", "service.transport"]
    assert modules(room), f"{room} has no modules: the layout changed, update this test"
    for path in modules(room):
        bad = reaches(imports(path), *forbidden)
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_the_service_root_holds_only_the_top() -> None:
    """Every concept lives in a room; the root keeps the processes' entry points and nothing else."""
    names = {p.name for p in (ROOT / "service").glob("*.py")}
    assert names <= {"__init__.py", "cli.py", "commands.py", "supervisor.py", "inprocess.py", "launcher.py"}, names


def test_the_ground_does_not_import_torch_at_import_time() -> None:
    """The ONNX serving path stays torch-free: core may import torch only inside the function that needs it."""
    for path in modules("service/core"):
        bad = reaches(imports(path, top_level_only=True), "torch", "torchvision")
        assert not bad, f"{path.relative_to(ROOT)} imports {bad} at import time"


def test_runtimes_and_the_engine_know_no_http() -> None:
    for folder in ("service/runtime", "service/engine", "service/transport", "service/core"):
        for path in modules(folder):
            bad = reaches(imports(path), "litestar", "uvicorn", "grpc")
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_runtimes_import_no_asyncio() -> None:
    for path in modules("service/runtime"):
        bad = reaches(imports(path), "asyncio")
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_the_server_never_needs_the_model_zoo_or_export() -> None:
    """The repository on disk is the only contract: serving an artifact needs neither models/ nor export/."""
    for path in modules("service"):
        if path.name in ("cli.py", "commands.py"):  # the command line dispatches to every package, lazily
            continue
        if {"tune", "bench"} & set(path.relative_to(ROOT / "service").parts):  # tools on top: they run the load tester
            continue
        bad = reaches(imports(path), "models", "export", "loadtest")
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_the_load_tester_talks_only_to_a_server() -> None:
    for path in modules("loadtest"):
        bad = reaches(imports(path), "models", "export", "torch")
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_the_client_stands_on_core_alone_but_for_its_in_process_mode() -> None:
    """The client imports core, httpx and the like; only commands.py reaches the in-process server, inside the
    command, for the mode without --url."""
    for path in modules("service/client"):
        lazy = path.name == "commands.py"
        bad = reaches(imports(path, top_level_only=lazy), "service.runtime", "service.inprocess", "torch")
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_importing_the_client_loads_no_server_and_no_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, service.client, service.client.commands; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'litestar', 'onnxruntime') "
        "or m.startswith(('service.runtime', 'service.engine', 'service.frontend', 'service.transport'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout


def test_no_module_over_500_lines_and_no_function_over_80() -> None:
    """A newcomer reads a module in one sitting and a function on one screen (STYLE.md: split past 500)."""
    too_long: list[str] = []
    for folder in ("service", "models", "export", "loadtest", "deploy", "scripts"):
        for path in modules(folder):
            if path.name.endswith("_pb2.py"):  # generated by scripts/gen_protocol.py
                continue
            text = path.read_text()
            if text.count("\n") > 500:
                too_long.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    length = (node.end_lineno or node.lineno) - node.lineno + 1
                    if length > 80:
                        too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines")
    assert not too_long, too_long
