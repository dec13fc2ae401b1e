"""What the GPU machine brings, what is carried to it as wheels (``.whl/``, installed into ``.site/`` with
``pip --no-index --no-deps``), and which carried wheels this Python can install. How CI checks the two lists:
docs/gpu-check.md, "Wheels to carry"."""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from typing import Any

# The distributions the GPU machine's image brings (its package list, read on 2026-11-17). Never carried: a second
# version of one of them stops the install there, and a second torch would break CUDA.
MACHINE_HAS = frozenset(
    """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs certifi
    charset-normalizer click cloudpickle colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
    cuda-toolkit cupy-cuda13x cycler filelock fonttools frozenlist fsspec grpcio h11 httpcore httpx idna imageio
    iniconfig jinja2 joblib kiwisolver markdown-it-py markupsafe matplotlib mdurl ml-dtypes mpmath msgpack multidict
    networkx numpy nvidia-ml-py onnx onnx-ir onnxruntime onnxscript opencv-python-headless packaging pillow pip pluggy
    prometheus-client propcache protobuf psutil pygments pyparsing pytest pytest-timeout python-dateutil pyyaml
    requests rich scikit-learn scipy setuptools six sympy threadpoolctl torch torchvision tqdm triton typer
    typing-extensions urllib3 uvloop wheel yarl hypothesis sortedcontainers""".split()  # noqa: SIM905 (a list, as read)
)
# Import name -> distribution, for what the serving path (serve, export, bench, loadtest, train) needs beyond the
# machine's own packages. Only what fails to import there is ever installed.
CARRIED = {
    "litestar": "litestar", "litestar_htmx": "litestar-htmx", "msgspec": "msgspec", "multipart": "multipart",
    "python_multipart": "python-multipart", "polyfactory": "polyfactory", "faker": "faker",
    "rich_click": "rich-click", "sniffio": "sniffio", "uvicorn": "uvicorn", "httptools": "httptools",
    "zmq": "pyzmq", "swagger_ui_bundle": "swagger-ui-bundle-v2", "websockets": "websockets",
    # LitServe, the peer `make gpu-speed` serves the same model in (service/bench/litserve_app.py), and what
    # it needs beyond the machine's packages and the above.
    "litserve": "litserve", "fastapi": "fastapi", "starlette": "starlette", "pydantic": "pydantic",
    "pydantic_core": "pydantic-core", "annotated_types": "annotated-types", "typing_inspection": "typing-inspection",
    "opentelemetry.trace": "opentelemetry-api",
}  # fmt: skip
# Never installed from .whl/, even when a wheel is there: the machine's own builds of these must stay.
NEVER_INSTALL = ("torch", "torchvision", "numpy", "pillow", "onnx", "onnxruntime", "onnxruntime-gpu", "triton")
# The one module installed by two distributions (the CPU and the CUDA build of onnxruntime).
SAME_MODULE = {"onnxruntime-gpu": "onnxruntime"}


def normalize(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503)."""
    name = re.sub(r"[-_.]+", "-", name).lower()
    return SAME_MODULE.get(name, name)


def carried_distributions() -> list[str]:
    """The distributions to download into ``.whl/``, sorted."""
    return sorted({normalize(d) for d in CARRIED.values()})


def download_command(python_version: str = "3.12", folder: str = ".whl") -> list[str]:
    """``pip download`` of every carried wheel for ``python_version`` on x86-64 Linux, without dependencies, at the
    versions of ``constraints.txt``."""
    platforms = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                 "manylinux1_x86_64", "any"]  # fmt: skip
    cmd = ["python3", "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
           python_version, "--implementation", "cp", *(w for p in platforms for w in ("--platform", p))]  # fmt: skip
    # The versions the suite ran with: without dependencies pip takes each name's newest on its own, and a pair
    # that must match (pydantic pins pydantic-core exactly) could come apart.
    constraints = Path(__file__).resolve().parents[2] / "constraints.txt"
    pinned = ["-c", str(constraints)] if constraints.is_file() else []
    return [*cmd, *pinned, "-d", folder, *carried_distributions()]


def wheel_tags(wheel: Path) -> set[str]:
    """The ``interpreter-abi-platform`` tags a wheel's file name claims (PEP 427's compressed tag sets expanded)."""
    parts = wheel.name[: -len(".whl")].split("-")
    python, abi, platform = parts[-3], parts[-2], parts[-1]
    return {f"{i}-{a}-{p}" for i in python.split(".") for a in abi.split(".") for p in platform.split(".")}


def choose_wheels(
    wheels: Sequence[Path], missing: set[str], supported: Iterable[str] | None = None
) -> tuple[list[Path], list[Path], list[Path]]:
    """(to install: wheels of missing distributions that this Python can install; refused: the machine's own
    packages; for another Python: wheels of missing distributions whose tags this interpreter does not support).

    ``supported`` is this interpreter's tags (``packaging.tags.sys_tags()``; given in tests)."""
    if supported is None:
        from packaging.tags import sys_tags

        supported = (str(t) for t in sys_tags())
    ok, wanted = set(supported), {normalize(m) for m in missing}
    chosen: list[Path] = []
    refused: list[Path] = []
    other_python: list[Path] = []
    for wheel in wheels:
        dist = normalize(wheel.name.split("-")[0])
        if dist in NEVER_INSTALL or dist.startswith("nvidia-"):
            refused.append(wheel)
        elif dist in wanted:
            (chosen if wheel_tags(wheel) & ok else other_python).append(wheel)
    return chosen, refused, other_python


def hide_all_but_the_machines(first: Collection[str]) -> None:
    """Make this interpreter import only what the GPU machine can: the standard library, the project's own packages
    (``first``), :data:`MACHINE_HAS` and :data:`CARRIED`. Any other import fails as it would there, and a probe for an
    optional module (``importlib.util.find_spec``) sees it absent. For CI's checks of the carried wheels."""
    import importlib.abc
    import importlib.metadata
    import importlib.util
    import sys
    from importlib.machinery import ModuleSpec

    allowed = MACHINE_HAS | set(carried_distributions())
    owners = importlib.metadata.packages_distributions()

    class Hidden(importlib.abc.MetaPathFinder):
        def find_spec(self, name: str, path: Any, target: Any = None) -> ModuleSpec | None:
            top = name.partition(".")[0]
            dists = {normalize(d) for d in owners.get(top, [])}
            if top in sys.stdlib_module_names or top in first or not dists or dists & allowed:
                return None
            raise ModuleNotFoundError(f"hidden: {top} ({', '.join(sorted(dists))})", name=top)

    probe = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> ModuleSpec | None:
        try:
            return probe(name, package)
        except ModuleNotFoundError as exc:
            if str(exc).startswith("hidden:"):
                return None
            raise

    importlib.util.find_spec = find_spec
    sys.meta_path.insert(0, Hidden())
