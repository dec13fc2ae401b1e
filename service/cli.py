"""The ``visionserve`` command: one entry point, a subcommand per job.

Each subcommand lives beside the code it drives (``models/commands.py``, ...) as a pair ``add_arguments(parser)``
and ``run(args) -> int``; heavy imports happen inside ``run`` so ``visionserve --help`` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Sequence

from service.core.arguments import HelpFormatter, comma_floats, comma_ints, size_pair
from service.core.errors import ConfigError, VisionServeError

__all__ = ["build_parser", "comma_floats", "comma_ints", "main", "size_pair"]

# name -> (module, help). Each module defines add_arguments(parser) and run(args) -> int.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("models.commands", "train a model on digits, a folder of images, or synthetic data [and export it]"),
    "models": ("models.commands", "list the architectures (and the repository's models)"),
    "serve": ("service.commands", "serve the repository's models over HTTP"),
    "bench": ("service.bench.commands", "measure the engine in-process, or a served scenario against its targets"),
    "loadtest": ("loadtest.commands", "load a server over HTTP and report throughput and latency"),
    "classify": (
        "service.client.commands",
        "classify image files and folders to CSV/JSONL, via a server or in-process",
    ),
    "detect": (
        "service.client.commands",
        "find the objects in image files and folders with a detector, to CSV/JSONL, via a server or in-process",
    ),
    "segment": (
        "service.client.commands",
        "outline the objects in image files and folders with a segmenter, to COCO JSON/JSONL/CSV, via a server or "
        "in-process",
    ),
    "export": ("export.commands", "export to ONNX, TorchScript or AOTInductor with proven parity into a repository"),
    "tune": ("service.tune.commands", "find the settings that serve the most at a p99 target here, and prove it"),
    "rollout": ("service.client.rollout", "start, watch, promote or abort a server's rollout of a candidate version"),
    "watch": ("service.client.watch", "print or save a source's answers as they come"),
}


def _run_train(args: argparse.Namespace) -> int:
    """``train`` is models/'s command; its ``--export`` step is export/'s, which models/ may not import: handed in
    here, where the command line stands on both."""
    from export.after_training import prepare_export
    from models.commands import run_train

    return run_train(args, export=prepare_export)


# A module a command needs that the serving install leaves out -> the extra that brings it (pyproject.toml).
EXTRAS = {"torch": "torch", "torchvision": "torch", "sklearn": "train", "onnxscript": "train", "rich": "cli",
          "matplotlib": "cli", "httpx": "cli", "onnxruntime": "cpu"}  # fmt: skip


# Commands whose whole job lives in one extra: theirs is named whatever module they missed first.
COMMAND_EXTRAS = {"train": "train", "export": "train"}


def missing_extra(exc: ModuleNotFoundError, command: str | None = None) -> str | None:
    """The extra that would install what ``exc`` says is missing (None: not one of ours to name)."""
    extra = EXTRAS.get((exc.name or "").partition(".")[0])
    return COMMAND_EXTRAS.get(command or "", extra) if extra is not None else None


# Commands whose run needs more than their own module (name -> run); the others run their module's run_{name}.
RUNS: dict[str, Callable[[argparse.Namespace], int]] = {"train": _run_train}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with ``only``, the other subcommands' modules are not imported (they are listed,
    without their flags). ``models`` imports torch, so building every subcommand cost ``serve``'s supervisor
    2 s and about 600 MB of resident memory for nothing."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--log-level",
        default="warning",
        choices=["debug", "info", "warning", "error"],
        help="logging level",
    )
    common.add_argument("--no-progress", action="store_true", help="do not draw progress bars")
    parser = argparse.ArgumentParser(
        prog="visionserve",
        description="Serve image-classification CNNs with dynamic batching on GPU or CPU.",
        formatter_class=HelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, parents=[common], formatter_class=HelpFormatter)
        if only is not None and name != only:
            continue
        module = importlib.import_module(module_name)
        getattr(module, f"add_{name}_arguments")(p)
        p.set_defaults(_run=RUNS.get(name) or getattr(module, f"run_{name}"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    command = next((w for w in words if not w.startswith("-")), None)
    # No subcommand named (plain --help, or a mistake): list them all and import none; `models` and `train` import
    # torch, which made `visionserve --help` take 3.6-5.4 s.
    try:
        parser = build_parser(command if command in SUBCOMMANDS else "")
        args = parser.parse_args(words)
        logging.basicConfig(
            level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        return int(args._run(args) or 0)
    except ModuleNotFoundError as exc:
        extra = missing_extra(exc, command)
        if extra is None:
            raise
        print(
            f"visionserve {command}: error: this command needs {exc.name}, which the serving install leaves out: "
            f"install the '{extra}' extra (pip install -c constraints.txt -e '.[{extra}]', or `make install` for "
            "everything a developer uses)",
            file=sys.stderr,
        )
        return 2
    except VisionServeError as exc:  # a configuration refused is a usage error (2); the rest a failure (1)
        print(f"visionserve {command}: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
    except KeyboardInterrupt:
        print(f"visionserve {command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
