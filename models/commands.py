"""``visionserve train`` and ``visionserve models``. Heavy imports wait until a command runs.

``train --export`` goes on, after training, to export the checkpoint into a model repository (and ``--reload`` a
running server). That step is export/'s, which models/ stands below and may not import, so the command line hands
it in (:data:`PrepareExport`, ``service/cli.py``).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from service.core.arguments import number_in
from service.core.errors import ConfigError

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import TaskID

    from models.checkpoint import EpochRecord
    from models.config import TrainConfig
    from models.train import TrainResult

_DEFAULTS_NOTE = "smallcnn on digits with these defaults reaches >= 97% validation accuracy in well under a minute"


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.description = f"Train a model and write a checkpoint (weights, spec, training record). {_DEFAULTS_NOTE}."
    p.add_argument("--arch", default="smallcnn", help="architecture (see `visionserve models`)")
    p.add_argument(
        "--dataset",
        default="digits",
        help="digits (scikit-learn's bundled handwritten digits), folder:PATH (one sub-folder per class), "
        "or synthetic[:N] (generated images); for a detector (--arch digitdet): canvases (those digits pasted on "
        "generated images)",
    )
    p.add_argument(
        "--epochs",
        type=int,
        default=None,
        help="training epochs (default: 15; detectors 14, an epoch being 50 steps of fresh canvases); with --resume, "
        "more than the checkpoint's extends its run",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="images per optimisation step (per process) (default: 32; detectors 64)",
    )
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help="peak learning rate (default: 0.05, SGD on a one-cycle schedule; detectors 0.003, AdamW with a warm-up "
        "then a cosine decay)",
    )
    p.add_argument("--weight-decay", type=float, default=5e-4, help="weight decay")
    p.add_argument("--seed", type=int, default=0, help="random seed; the same seed repeats a run")
    p.add_argument("--device", default="auto", help="auto (CUDA when usable, else CPU), cpu, cuda or cuda:N")
    p.add_argument("--input-size", type=int, default=None, help="square input size; default: the architecture's own")
    p.add_argument(
        "--weights", default=None, help="start from these weights (a state dict or a visionserve checkpoint)"
    )
    p.add_argument(
        "--out",
        default="checkpoints/digits.pt",
        help="checkpoint, written atomically after every epoch (resumable with --resume); the best epoch by "
        "validation accuracy is kept beside it as NAME.best.pt",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="folder datasets: DataLoader worker processes decoding images (0: in the training process); "
        "default: the usable cores less one, at most 8",
    )
    p.add_argument(
        "--loader",
        default="auto",
        choices=["auto", "memory", "stream"],
        help="folder datasets: decode every image once into memory, or stream them from disk each epoch; auto: "
        "memory with --workers 0 for folders whose decoded images take at most 64 MiB, else stream",
    )
    p.add_argument(
        "--no-augment",
        action="store_true",
        help="folder datasets: train on the served transform (resize, centre crop) instead of random resized "
        "crops and horizontal flips",
    )
    p.add_argument(
        "--limit-batches",
        type=int,
        default=None,
        help="train and validate on at most this many batches per epoch (benchmarks, smoke runs; detectors: steps "
        "per epoch, and held-out canvases of that many batches); default: all",
    )
    p.add_argument(
        "--resume",
        default=None,
        help="continue the run in this checkpoint (default: none): an interrupted run to its --epochs, or any run "
        "past them with a larger --epochs (its one-cycle schedule rebuilt for the new total); --arch, --dataset "
        "and its classes, --input-size, --batch-size, --lr and --seed must be the checkpoint's",
    )
    _add_export_arguments(p)


def _add_export_arguments(p: argparse.ArgumentParser) -> None:
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
        "API (or, with --rollout, to put it on trial); needs its admin token in --admin-token or "
        "VISIONSERVE_ADMIN_TOKEN",
    )
    g.add_argument("--admin-token", default=None, help="with --reload: the server's admin token")
    g.add_argument(
        "--rollout",
        default=None,
        choices=["shadow", "canary"],
        help="with --reload: instead of loading the new version, start a rollout of it beside the version the "
        "server serves (docs/rollouts.md): shadow (compared, never returned) or canary (answers a fraction); "
        "default: none (load it)",
    )
    g.add_argument(
        "--rollout-fraction",
        type=number_in(0, 1),
        default=0.1,
        metavar="F",
        help="with --rollout: the fraction of the requests that name no version which the new version computes",
    )


class _RichProgress:
    """A progress bar per epoch with running loss and accuracy, and a line per finished epoch."""

    def __init__(self, epochs: int, enabled: bool, *, accuracy: bool = True) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = Console(stderr=True)
        self.epochs = epochs
        self.progress = Progress(
            TextColumn("epoch {task.fields[epoch]}/{task.fields[epochs]}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]:.4f}" + ("  acc {task.fields[acc]:.1%}" if accuracy else "")),
            TimeElapsedColumn(),
            console=self.console,
            transient=True,
            disable=not enabled,
        )
        self.task: TaskID | None = None

    def start_epoch(self, epoch: int, batches: int) -> None:
        if self.task is not None:
            self.progress.remove_task(self.task)
        self.task = self.progress.add_task("train", total=batches, epoch=epoch, epochs=self.epochs, loss=0.0, acc=0.0)

    def advance(self, loss: float, accuracy: float) -> None:
        if self.task is not None:
            self.progress.update(self.task, advance=1, loss=loss, acc=accuracy)

    def note(self, line: str) -> None:
        """A line above the bar (a detector's finished epoch)."""
        self.console.print(line)

    def end_epoch(self, record: EpochRecord) -> None:
        val = "n/a" if record.val_accuracy is None else f"{record.val_accuracy:.2%}"
        busy = record.data_wait_s + record.compute_s
        wait = record.data_wait_s / busy if busy > 0 else 0.0
        skipped = f"  {record.skipped_images} unreadable skipped" if record.skipped_images else ""
        self.console.print(
            f"epoch {record.epoch:>3}/{self.epochs}  loss {record.train_loss:.4f}  "
            f"train acc {record.train_accuracy:.2%}  val acc {val}  ({record.duration_s:.1f} s)  "
            f"{record.images_per_s:.0f} images/s, data wait {record.data_wait_s:.1f} s ({wait:.0%}), "
            f"compute {record.compute_s:.1f} s{skipped}"
        )


# (epochs, batch size, learning rate) when the flags leave them out, by the architecture's task.
TASK_DEFAULTS = {"classify": (15, 32, 0.05), "detect": (14, 64, 3e-3), "segment": (14, 64, 3e-3)}


class Trainer(NamedTuple):
    """How an architecture's task trains: its loop, its summary, whether its bar shows accuracy, and whether it
    trains on generated canvases (and on nothing else)."""

    loop: Callable[..., TrainResult]
    summary: Callable[[TrainConfig, TrainResult], None]
    accuracy: bool
    canvases: bool


def _trainers() -> dict[str, Trainer]:
    from models.detect_train import train_detector
    from models.train import train

    canvas = Trainer(train_detector, _detector_summary, accuracy=False, canvases=True)
    return {"classify": Trainer(train, _classifier_summary, accuracy=True, canvases=False), "detect": canvas,
            "segment": canvas}  # fmt: skip


def train_from_args(args: argparse.Namespace) -> TrainResult:
    """Run training as the flags say (each architecture's task by its own loop), with progress bars; rank 0 prints
    the summary."""
    from models.registry import get_architecture
    from models.train import TrainConfig

    task = get_architecture(args.arch).task
    if task not in TASK_DEFAULTS:
        raise ConfigError(f"{args.arch} ({task}) has no training loop here: export it with its own weights "
                          f"(`visionserve export --arch {args.arch} --weights FILE`, docs/detection.md)")  # fmt: skip
    epochs, batch_size, lr = TASK_DEFAULTS[task]
    trainer = _trainers()[task]
    if args.dataset == "canvases" and not trainer.canvases:
        raise ConfigError(
            "--dataset canvases trains a detector or a segmenter: choose --arch digitdet or digitseg (see "
            "`visionserve models`)"
        )
    # Each of TrainConfig's fields from the flag of its name; a flag left out (None) takes the task's default.
    given = {f: getattr(args, f) for f in TrainConfig.__struct_fields__ if getattr(args, f, None) is not None}
    config = TrainConfig(**{"epochs": epochs, "batch_size": batch_size, "lr": lr, **given}, augment=not args.no_augment)
    bar = _RichProgress(config.epochs, enabled=not args.no_progress, accuracy=trainer.accuracy)
    with bar.progress:
        result = trainer.loop(config, progress=bar)
    if result.rank != 0:
        return result
    trainer.summary(config, result)
    if result.path:
        print(f"checkpoint written to {result.path}")
    if result.best_path:
        best = f"{result.record.best_val_accuracy:.2%}" if result.record.best_val_accuracy is not None else "n/a"
        print(f"best epoch {result.record.best_epoch} (validation accuracy {best}) kept in {result.best_path}")
    return result


def _classifier_summary(config: TrainConfig, result: TrainResult) -> None:
    rec = result.record
    val = "n/a" if rec.val_accuracy is None else f"{rec.val_accuracy:.2%}"
    print(
        f"trained {config.arch} on {rec.dataset} ({rec.train_size} train / {rec.val_size} val images) "
        f"on {rec.device} in {rec.duration_s:.1f} s: validation accuracy {val}"
    )
    if rec.skipped_images:
        shown = ", ".join(f"{s.path} ({s.reason})" for s in rec.skipped[:5])
        more = (
            f" and {rec.skipped_images - 5} more (the checkpoint's record lists them)" if rec.skipped_images > 5 else ""
        )
        print(f"skipped {rec.skipped_images} unreadable images: {shown}{more}")
    for warning in rec.warnings:
        print(f"warning: {warning}")


def _detector_summary(config: TrainConfig, result: TrainResult) -> None:
    """A detector's run (``models/detect_train.py``) and its held-out figures."""
    rec, det = result.record, result.record.detection
    assert det is not None
    per_class = "  ".join(f"{label} {'n/a' if ap is None else f'{ap:.3f}'}" for label, ap in det.ap_50.items())
    print(
        f"trained {config.arch} on {rec.dataset} ({det.steps} steps, {det.canvases_seen} canvases of "
        f"{det.train_digits} training digits) on {rec.device} in {rec.duration_s:.1f} s "
        f"({det.generate_s:.1f} s making canvases; torch threads: {det.threads})"
    )
    print(
        f"held out ({det.heldout_canvases} canvases of {len(det.heldout_digits)} unseen digits): "
        f"mAP@0.5 {det.map_50:.3f}  mAP@0.75 {det.map_75:.3f}"
    )
    print(f"AP@0.5 per class: {per_class}")
    if det.mask_ap is not None:
        print(f"masks (pycocotools COCOeval, segm): AP@[.5:.95] {det.mask_ap:.3f}  AP@0.5 {det.mask_ap_50:.3f}  "
              f"AP@0.75 {det.mask_ap_75:.3f}")  # fmt: skip


ExportStep = Callable[[str], int]
"""Exports the checkpoint at a path after training; the command's exit status."""
PrepareExport = Callable[[argparse.Namespace], ExportStep]
"""Checks the ``--export`` flags (before a long training run, not after it) and gives the step that runs after."""


def run_train(args: argparse.Namespace, *, export: PrepareExport | None = None) -> int:
    """``visionserve train``; with ``--export``, ``export`` (handed in by the command line) runs after training on
    rank 0, on the checkpoint written."""
    if args.rollout and not args.reload:
        raise ConfigError("--rollout starts a rollout on the server that --reload names: add --reload URL")
    step: ExportStep | None = None
    if args.export:
        if export is None:
            raise ConfigError("--export needs the export step, which `visionserve train` hands in")
        step = export(args)
    elif args.reload:
        raise ConfigError("--reload loads what --export wrote: add --export")
    result = train_from_args(args)
    if step is None or result.rank != 0 or result.path is None:
        return 0
    return step(result.path)


def add_models_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repository", default="model_repository", help="model repository to list, if it exists")


def run_models(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    from models.registry import architecture_names, get_architecture

    table = Table(title="architectures")
    for column in ("name", "input (CxHxW)", "resize", "params", "classes", "description"):
        table.add_column(column)
    for name in architecture_names():
        arch = get_architecture(name)
        with torch.device("meta"):  # count parameters without allocating them
            params = sum(p.numel() for p in arch.build().parameters())
        spec = arch.spec
        table.add_row(
            name,
            f"{spec.input.channels}x{spec.input.height}x{spec.input.width}",
            f"{spec.resize_size} {spec.interpolation}",
            f"{params / 1e6:.2f} M",
            str(spec.num_classes),
            arch.description,
        )
    console = Console(file=sys.stdout, width=max(shutil.get_terminal_size((140, 24)).columns, 120))
    console.print(table)
    _print_repository(console, args.repository)
    return 0


def _print_repository(console: Console, root: str) -> None:
    from pathlib import Path

    from rich.table import Table

    from service.core.repository import ModelRepository

    if not Path(root).is_dir():
        print(f"(no model repository at {root})")
        return
    index = ModelRepository(root).scan(deep=False)
    table = Table(title=f"models in {root}")
    for column in ("model", "versions", "formats (latest)", "input", "classes", "state"):
        table.add_column(column)
    for name, entry in index.models.items():
        latest = entry.latest
        formats = sorted(latest.files) + [f"{f} fp16" for f in sorted(latest.fp16_files)]
        spec = latest.spec
        broken = f"; refused versions: {sorted(entry.version_errors)}" if entry.version_errors else ""
        table.add_row(
            name,
            ", ".join(str(v) for v in sorted(entry.versions)),
            ", ".join(formats),
            f"{spec.input.channels}x{spec.input.height}x{spec.input.width}",
            str(spec.num_classes),
            "ok" + broken,
        )
    for name, error in index.errors.items():
        table.add_row(name, "-", "-", "-", "-", f"refused: {error}")
    console.print(table)
