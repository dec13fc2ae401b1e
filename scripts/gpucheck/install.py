"""The install step of a prepared GPU command: what fails to import is installed from the carried wheels
(``.whl/``) into ``.site/`` with ``pip --no-index --no-deps``, never one of the machine's own packages."""

from __future__ import annotations

import importlib
import platform
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gpucheck.proc import StepError
from gpucheck.wheels import CARRIED, choose_wheels, download_command

IMPORT_PROBE = (
    "import importlib, sys\nfor m in sys.argv[1:]:\n    try:\n        importlib.import_module(m)\n"
    "    except Exception:\n        print(m)"
)
Run = Callable[[list[str], float, str], Any]  # StepRunner.run: (command, timeout_s, log) -> CompletedProcess


def unimportable(run: Run, modules: Sequence[str]) -> list[str]:
    """The modules that fail to import, tried in one fresh interpreter with the carried packages on the path."""
    return str(run([sys.executable, "-c", IMPORT_PROBE, *modules], 120, "imports").stdout).split()


def install_carried(run: Run, needed: Sequence[str], wheels_dir: Path, site: Path) -> tuple[dict[str, Any], set[str]]:
    """Install the carried wheels of whatever of ``needed`` does not import; (the step's figures, the modules that
    still do not import)."""
    missing_before = unimportable(run, needed)
    missing = {CARRIED[m] for m in missing_before if m in CARRIED}
    wheels = sorted(wheels_dir.glob("*.whl")) if wheels_dir.is_dir() else []
    chosen, refused, other_python = choose_wheels(wheels, missing)
    result: dict[str, Any] = {
        "missing_before": sorted(missing_before),
        "wheels_dir": str(wheels_dir),
        "wheels_mb": round(sum(w.stat().st_size for w in wheels) / 1e6, 1),
        "installed": [w.name for w in chosen],
        "refused_never_reinstalled": [w.name for w in refused],
        "refused_for_another_python": [w.name for w in other_python],
    }
    if other_python:
        version = platform.python_version().rpartition(".")[0]
        result["hint"] = f"carried for another Python: {' '.join(download_command(version))}"
    still = missing_before
    if chosen:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--disable-pip-version-check", "--upgrade", "--target", str(site), *map(str, chosen)]  # fmt: skip
        proc = run(cmd, 300, "install")
        if proc.returncode != 0:
            raise StepError(f"pip install from {wheels_dir} failed: {proc.stderr.strip()[-400:]}")
        importlib.invalidate_caches()
        still = unimportable(run, needed)  # again only when something was installed
    result["missing_after"] = sorted(still)
    return result, set(still)
