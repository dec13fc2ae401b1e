"""``visionserve train --export``: the checkpoint a training run wrote, into a model repository.

The checkpoint becomes the model's next version, parity-gated exactly as ``visionserve export`` does (nothing
reaches the repository unless it matches eager PyTorch). With ``--reload URL`` a running server is then asked to
load the new version through its repository API (``POST /v2/repository/models/{name}/load``), or, with
``--rollout shadow|canary``, to put it on trial beside the version it serves (``POST /v2/models/{name}/rollout``,
docs/rollouts.md). The ``train`` command is ``models/commands.py``'s; ``service/cli.py`` hands it
:func:`prepare_export`, since models/ stands below export/ and may not import it.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from service.core.errors import ConfigError


def export_name(dataset: str, name: str | None) -> str:
    """The repository name: ``--name``, else the folder's own name made safe, else the dataset's name."""
    if name:
        return name
    base = Path(dataset.removeprefix("folder:")).resolve().name if dataset.startswith("folder:") else dataset
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", base.split(":")[0]).strip(".-") or "model"


def prepare_export(args: argparse.Namespace) -> Callable[[str], int]:
    """Refuse bad ``--export`` flags before, not after, a long training run; the step that exports the checkpoint
    once it is written (its exit status: 1 when an artifact failed its parity check)."""
    from export.exporter import ExportRequest, check_request

    if not args.out:
        raise ConfigError("--export exports the checkpoint that --out names: give --out a path")
    formats = tuple(f.strip() for f in args.formats.split(",") if f.strip())
    request = ExportRequest(name=export_name(args.dataset, args.name), repository=args.repository, formats=formats)
    check_request(request)
    token = args.admin_token or os.environ.get("VISIONSERVE_ADMIN_TOKEN")
    if args.reload and not token:
        raise ConfigError("--reload needs the server's admin token: --admin-token or VISIONSERVE_ADMIN_TOKEN")

    def export_checkpoint(path: str) -> int:
        from export import exporter, sources
        from export.commands import print_report

        report = exporter.export_source(
            sources.from_checkpoint(path),
            request,
            progress=None if args.no_progress else (lambda msg: print(f"  {msg}", flush=True)),
        )
        print_report(report)
        if not report.ok:
            return 1
        if args.reload and args.rollout and report.version > 1:
            start_rollout(args.reload, request.name, str(token), report.version, args.rollout, args.rollout_fraction)
        elif args.reload:
            if args.rollout:  # a first version has nothing to be compared with: it is simply served
                print(f"version 1 is {request.name}'s first: nothing to compare it with, so it is loaded instead")
            reload_model(args.reload, request.name, str(token))
        return 0

    return export_checkpoint


def reload_model(url: str, name: str, token: str) -> None:
    """Ask the server at ``url`` to (re)load ``name``, which serves its highest version."""
    _post_admin(url, f"/v2/repository/models/{name}/load", token, "--reload")
    print(f"{url} loaded {name}")


def start_rollout(url: str, name: str, token: str, candidate: int, mode: str, fraction: float) -> None:
    """Ask the server at ``url`` to put ``name`` version ``candidate`` on trial beside the version it serves."""
    body = {"candidate": candidate, "mode": mode, "fraction": fraction}
    answer = _post_admin(url, f"/v2/models/{name}/rollout", token, "--rollout", body)
    primary = answer.get("primary") if isinstance(answer, dict) else None
    against = f"against version {primary}" if primary is not None else "against the version it serves"
    print(
        f"{url} started a {mode} rollout of {name} version {candidate} {against} on {fraction:.0%} of the requests "
        f"that name no version; follow it with: visionserve rollout status --url {url} --model {name}"
    )


def _post_admin(url: str, path: str, token: str, flag: str, body: dict[str, Any] | None = None) -> Any:
    """POST ``body`` to an admin route of the server at ``url``; its JSON answer (None when it is not JSON)."""
    import httpx

    try:
        response = httpx.post(
            url.rstrip("/") + path, json=body, headers={"Authorization": f"Bearer {token}"}, timeout=120.0
        )
    except httpx.HTTPError as exc:
        raise ConfigError(f"{flag} {url}: the server could not be reached ({exc})") from exc
    if response.status_code != 200:
        raise ConfigError(f"{flag} {url}: the server answered {response.status_code}: {response.text[:300]}")
    try:
        return response.json()
    except ValueError:
        return None
