"""``visionserve train``, and with ``--export`` train -> serve in one command.

Training itself is ``models/commands.py``; with ``--export`` the checkpoint it wrote is then exported into a
model repository as the model's next version, parity-gated exactly as ``visionserve export`` does (nothing
reaches the repository unless it matches eager PyTorch). With ``--reload URL`` a running server is asked to load
the new version through its repository API (``POST /v2/repository/models/{name}/load``). This module lives in
``export/`` because export stands on models, never the other way round.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from models.commands import add_train_arguments as _add_training_arguments
from models.commands import train_from_args
from service.core.errors import ConfigError


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    _add_training_arguments(p)
    g = p.add_argument_group("export after training (train -> serve in one command)")
    g.add_argument(
        "--export",
        action="store_true",
        help="after training, export the checkpoint (--out) into --repository as the next version, parity-gated",
    )
    g.add_argument("--repository", default="model_repository", help="with --export: the model repository")
    g.add_argument(
        "--name",
        default=None,
        help="with --export: the model's name in the repository; default: the dataset folder's name "
        "(digits and synthetic: the dataset's name)",
    )
    g.add_argument("--formats", default="onnx,torchscript", help="with --export: onnx, torchscript and/or aoti")
    g.add_argument(
        "--reload",
        default=None,
        metavar="URL",
        help="with --export: a running server (http://HOST:PORT) to load the new version through its repository "
        "API; needs its admin token in --admin-token or VISIONSERVE_ADMIN_TOKEN",
    )
    g.add_argument("--admin-token", default=None, help="with --reload: the server's admin token")


def export_name(dataset: str, name: str | None) -> str:
    """The repository name: ``--name``, else the folder's own name made safe, else the dataset's name."""
    if name:
        return name
    base = Path(dataset.removeprefix("folder:")).resolve().name if dataset.startswith("folder:") else dataset
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", base.split(":")[0]).strip(".-") or "model"


def run_train(args: argparse.Namespace) -> int:
    request = None
    if args.export:
        from export.exporter import ExportRequest, _check_request

        if not args.out:
            raise ConfigError("--export exports the checkpoint that --out names: give --out a path")
        formats = tuple(f.strip() for f in args.formats.split(",") if f.strip())
        request = ExportRequest(name=export_name(args.dataset, args.name), repository=args.repository, formats=formats)
        _check_request(request)  # refuse bad export flags before, not after, a long training run
    elif args.reload:
        raise ConfigError("--reload loads what --export wrote: add --export")
    token = args.admin_token or os.environ.get("VISIONSERVE_ADMIN_TOKEN")
    if args.reload and not token:
        raise ConfigError("--reload needs the server's admin token: --admin-token or VISIONSERVE_ADMIN_TOKEN")
    result = train_from_args(args)
    if request is None or result.rank != 0 or result.path is None:
        return 0
    from export import exporter, sources
    from export.commands import print_report

    source = sources.from_checkpoint(result.path)
    report = exporter.export_model(
        source.eager,
        source.spec,
        request,
        real_images=source.real_images,
        real_source=source.real_source,
        source_sha256=source.sha256,
        progress=None if args.no_progress else (lambda msg: print(f"  {msg}", flush=True)),
    )
    print_report(report)
    if not report.ok:
        return 1
    if args.reload:
        reload_model(args.reload, request.name, str(token))
    return 0


def reload_model(url: str, name: str, token: str) -> None:
    """Ask the server at ``url`` to (re)load ``name``, which serves its highest version."""
    import httpx

    target = f"{url.rstrip('/')}/v2/repository/models/{name}/load"
    try:
        response = httpx.post(target, headers={"Authorization": f"Bearer {token}"}, timeout=120.0)
    except httpx.HTTPError as exc:
        raise ConfigError(f"--reload {url}: the server could not be reached ({exc})") from exc
    if response.status_code != 200:
        raise ConfigError(f"--reload {url}: the server answered {response.status_code}: {response.text[:300]}")
    print(f"{url} loaded {name}")
