"""From a fresh copy of this checkout to the README's first answer, as a new user meets it.

Copies the checkout's files (what git tracks, and what it would add) into a scratch folder, runs ``make serve`` there
on a free port and posts the README's image (``examples/digit-3.png``) until an answer comes. Prints the seconds from
``make serve`` to that answer (the serving install built from nothing, the default model copied, the server
started), the serving environment's size, whether ``import torch`` works in it (it must not), and the engine's own
start-up. pip's cache is off by default, so a warm cache on this machine does not flatter the figure.

    .venv/bin/python scripts/first_answer.py            # the figures, one per line
    .venv/bin/python scripts/first_answer.py --json     # and as one JSON object
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from service.launcher import free_port, stop_process  # noqa: E402  (the checkout first on the path)


def copy_checkout(target: Path) -> None:
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.split("\n")  # fmt: skip
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)


def answered(port: int, image: bytes) -> bool:
    url = f"http://127.0.0.1:{port}/v1/models/digits/classify?top_k=3"
    request = urllib.request.Request(url, data=image, headers={"Content-Type": "image/png"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return bool(response.status == 200 and b'"label"' in response.read())
    except (urllib.error.URLError, OSError):
        return False


def size_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink()) / 1e6


def measure(work: Path, *, timeout_s: float, pip_cache: bool) -> dict[str, Any]:
    copy_checkout(work)
    port = free_port()
    env = {**os.environ, **({} if pip_cache else {"PIP_NO_CACHE_DIR": "1"})}
    image = (work / "examples" / "digit-3.png").read_bytes()
    log = work / "make-serve.log"
    with open(log, "wb") as out:
        started = time.perf_counter()
        command = ["make", "serve", f"PORT={port}", "SERVE_ARGS=--log-level info"]
        make = subprocess.Popen(command, cwd=work, stdout=out, stderr=out, env=env, start_new_session=True)
    try:
        while not answered(port, image):
            if make.poll() is not None:
                raise SystemExit(f"first_answer: `make serve` exited {make.returncode}:\n{log.read_text()[-2000:]}")
            if time.perf_counter() - started > timeout_s:
                raise SystemExit(f"first_answer: no answer in {timeout_s:g} s:\n{log.read_text()[-2000:]}")
            time.sleep(0.1)
        first_answer_s = time.perf_counter() - started
    finally:
        stop_process(make, timeout_s=60, term_group=True)  # make and the server it started
    venv = work / ".venv-serve"
    torch = subprocess.run([str(venv / "bin" / "python"), "-c", "import torch"], capture_output=True)
    engine = re.search(r"engine engine0 serving after ([\d.]+) s", log.read_text())
    return {"first_answer_s": round(first_answer_s, 1), "environment_mb": round(size_mb(venv)),
            "torch_imports": torch.returncode == 0, "engine_start_s": float(engine[1]) if engine else None,
            "pip_cache": pip_cache}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser("first_answer", description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--timeout-s", type=float, default=300.0, help="most seconds to wait for the answer (default: 300)")
    p.add_argument("--pip-cache", action="store_true", help="let pip use its cache (default: off, as a new machine)")
    p.add_argument("--keep", default=None, help="build in this folder and keep it (default: a scratch folder)")
    p.add_argument("--json", action="store_true", help="also print the figures as one JSON object (default: off)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="first-answer-") as tmp:
        if args.keep:
            Path(args.keep).mkdir(parents=True, exist_ok=False)
        figures = measure(Path(args.keep or tmp), timeout_s=args.timeout_s, pip_cache=args.pip_cache)
    print(f"first answer to the README's curl: {figures['first_answer_s']} s after `make serve`"
          f" (pip cache {'on' if figures['pip_cache'] else 'off'})")  # fmt: skip
    print(f"serving environment: {figures['environment_mb']} MB; import torch there: "
          f"{'works' if figures['torch_imports'] else 'fails'}")  # fmt: skip
    print(f"engine start-up: {figures['engine_start_s']} s")
    if args.json:
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
