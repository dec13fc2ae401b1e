"""Property-based fuzzing of the whole OpenAPI schema against a real server: no 500, no response off-schema."""

from __future__ import annotations

import shutil
import subprocess
import sys
import warnings
from pathlib import Path

from service import inprocess
from service.core.settings import ServerSettings
from service.inprocess import InProcessServer


def test_schemathesis_finds_no_server_error_and_no_off_schema_response(server: InProcessServer) -> None:
    st = shutil.which("st") or str(Path(sys.executable).with_name("st"))
    proc = subprocess.run(
        [st, "run", f"{server.url}/schema/openapi.json", "--checks", "not_a_server_error,response_schema_conformance",
         "--max-examples", "20", "--request-timeout", "30", "--generation-deterministic", "--no-color"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert " passed" in proc.stdout


def test_building_the_app_warns_of_nothing(tmp_path: Path) -> None:
    """Every route's parameters are declared as Litestar wants them: building the app (each front end does at
    start) prints no deprecation warning to a user's log."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inprocess.create_app(ServerSettings(repository=str(tmp_path)))
    assert [str(w.message) for w in caught] == []
