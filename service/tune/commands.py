"""``visionserve tune``: the command line over :mod:`service.tune.tuner`, the report, and the written config (exit
statuses: the parser's description)."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from service.core.arguments import size_pair

EXIT_UNMET = 3
EXIT_INTERRUPTED = 130


def add_tune_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Find the serving settings that serve the most at a p99 target on this machine: measure the model "
        "in-process (every runtime and precision its files allow, per batch size and thread count, and the decode "
        "cost of the images), predict each configuration's capacity with a queueing simulation, verify the best "
        "few (and the current config and export's default) on a real server with the load tester's p99 search, "
        "and report. Exit status: 0 a configuration met the target; 3 none met it at any rate tried (the report "
        "gives the best p99 seen and its rate; nothing is written); 130 interrupted (the report keeps what was "
        "measured); 2 a bad argument or repository."
    )
    p.add_argument("--repository", default="model_repository", help="model repository folder")
    p.add_argument("--model", required=True, help="model name in the repository")
    p.add_argument("--slo-p99-ms", type=float, required=True, help="the p99 latency target, milliseconds")
    p.add_argument("--budget-s", type=float, default=600.0, help="wall-clock budget for the whole run, seconds")
    p.add_argument("--images", default=None, help="folder of images the load sends; default: generated JPEGs")
    p.add_argument("--image-size", type=size_pair, default=(500, 375), help="generated JPEGs: WIDTHxHEIGHT")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    p.add_argument(
        "--verify", type=int, default=4, help="best predicted candidates to verify, beside the current and default"
    )
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="front ends the current deployment runs (serve --workers); 0: serve's default",
    )
    p.add_argument(
        "--server-start-s",
        type=float,
        default=10.0,
        help="seconds a candidate server is assumed to take to start and stop until the first one is measured "
        "(planning only: a slower start is measured and counted from then on); default: 10",
    )
    p.add_argument("--out", default=None, help="folder for tune.json, tune.md and tune.png; default: tune-MODEL")
    p.add_argument(
        "--write",
        action="store_true",
        help="write the winner's config.toml into the repository (the previous one kept as config.toml.bak-TIME)",
    )
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")


def write_config(run: Any, folder_note: str) -> dict[str, Any]:
    """The winner's config.toml in the model's folder; the previous file renamed to a timestamped backup."""
    from service.core.config import CONFIG_FILE, load_config
    from service.tune.candidates import apply, config_text

    winner = run.winner
    o = run.options
    header = (
        f"Written by `visionserve tune` {datetime.date.today().isoformat()}: p99 <= {o.slo_p99_ms:g} ms, measured "
        f"{winner.best_rate:g} requests/s (p99 {winner.best_p99_ms:.1f} ms) on this machine.\n"
        f"Serve it with `visionserve serve --workers {winner.candidate.workers}`. Report: {folder_note}"
    )
    text = config_text(apply(run.base_config, winner.candidate), header)
    path = Path(o.repository) / o.model / CONFIG_FILE
    backup = None
    if path.exists():
        backup = path.with_name(f"{CONFIG_FILE}.bak-{datetime.datetime.now():%Y%m%d-%H%M%S}")
        shutil.copy2(path, backup)
    tmp = path.with_name(CONFIG_FILE + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    load_config(path)  # what was written loads (config_text checked it; this reads the file itself)
    return {"path": str(path), "backup": str(backup) if backup else None, "workers": winner.candidate.workers}


def run_tune(args: argparse.Namespace) -> int:
    import json

    from rich.console import Console

    from loadtest.report import new_table
    from service.core.errors import ConfigError, NotFoundError
    from service.core.repository import ModelRepository
    from service.tune import report as reporting
    from service.tune.tuner import TuneOptions, TuneRun, tune

    if args.slo_p99_ms <= 0 or args.budget_s <= 0 or args.server_start_s <= 0 or args.verify < 0 or args.workers < 0:
        raise ConfigError("--slo-p99-ms, --budget-s and --server-start-s must be > 0, --verify and --workers >= 0")
    try:  # a model or repository that is not there is a bad argument (exit 2, as the help says), not a failure
        ModelRepository(args.repository).model(args.model, deep=False)
    except NotFoundError as exc:
        raise ConfigError(str(exc)) from exc
    err = Console(stderr=True)
    out_dir = Path(args.out or f"tune-{args.model}")
    work = Path(tempfile.mkdtemp(prefix=f"tune-{args.model}-"))
    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(TuneOptions) if f.name != "work"}
    options = TuneOptions(**flags, work=str(work))  # every other option is the flag of its name
    run = TuneRun(options)

    def say(message: str) -> None:
        err.print(f"[dim]tune {run.elapsed():5.0f} s[/dim] {message}", highlight=False)

    try:
        tune(options, run, say)
    except KeyboardInterrupt:
        run.interrupted = True
        say("interrupted: writing the report with what was measured")
    finally:  # the candidates' repositories and server logs, whatever ended the run
        shutil.rmtree(work, ignore_errors=True)
    wanted = args.write and run.winner and not run.interrupted
    written = write_config(run, str(out_dir / "tune.md")) if wanted else None
    report = reporting.build(run, written)
    files = reporting.write(report, out_dir)
    if args.json:
        print(json.dumps(report))
    else:
        out = Console(file=sys.stdout, width=max(Console().width, 140))
        title = f"{args.model}: p99 <= {args.slo_p99_ms:g} ms, verified candidates"
        out.print(new_table(title, reporting.HEADER, ("candidate", "role"), rows=reporting.verified_rows(report)))
        out.print(report["message"])
        if written:
            backup = f"; the previous one is {written['backup']}" if written["backup"] else ""
            out.print(f"wrote {written['path']}{backup}; serve with --workers {written['workers']}")
        elif args.write and not run.winner:
            out.print("nothing written: no configuration met the target")
    err.print("report: " + ", ".join(str(f) for f in files))
    if run.interrupted:
        return EXIT_INTERRUPTED
    return 0 if run.winner else EXIT_UNMET
