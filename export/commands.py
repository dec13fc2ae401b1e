"""``visionserve export``. Heavy imports wait until the command runs."""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
from typing import TYPE_CHECKING

from service.core.errors import ConfigError, DatasetError
from service.core.layouts import LAYOUTS
from service.core.tasks import TASKS, task_named

if TYPE_CHECKING:
    from export.exporter import ExportReport, Int8Source
    from export.quantize import Int8Data
    from service.core.spec import ModelSpec


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _size(text: str) -> tuple[int, int]:
    parts = text.lower().replace("x", ",").split(",")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected SIZE or HxW, got {text!r}") from None
    if len(values) == 1:
        values *= 2
    if len(values) != 2 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected SIZE or HxW with positive numbers, got {text!r}")
    return values[0], values[1]


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Export a model to TorchScript, ONNX and/or AOTInductor (uint8 NCHW input, normalisation inside, "
        "dynamic batch), prove parity against eager PyTorch, and write a model repository entry."
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a visionserve checkpoint (from `visionserve train`)")
    src.add_argument("--arch", help="a zoo architecture with its initial weights (or --weights)")
    src.add_argument("--onnx", help="an ONNX model from elsewhere (float input); needs --labels")
    src.add_argument("--torchscript", help="a TorchScript model from elsewhere (float input); needs --labels")
    p.add_argument("--name", required=True, help="model name in the repository")
    p.add_argument("--version", type=int, default=None, help="version to write; default: the next free one")
    p.add_argument(
        "--formats",
        default="onnx,torchscript",
        help="comma-separated: onnx, torchscript, aoti (AOTInductor: model.pt2 for the CPU, and model.cuda.pt2 "
        "where a GPU is usable; its C++ compile takes ~1 min for resnet18 on 2 cores, so it is not a default)",
    )
    p.add_argument(
        "--aoti-devices",
        default="",
        help="with aoti: compile for cpu and/or cuda (comma-separated); empty: the CPU, and CUDA where usable",
    )
    p.add_argument("--fp16", action="store_true", help="also write fp16 variants (parity checked on a GPU)")
    p.add_argument("--opset", type=int, default=20, help="ONNX opset")
    p.add_argument("--repository", default="model_repository", help="model repository folder")
    p.add_argument("--max-batch-size", type=int, default=None, help="largest batch checked; default: config or 32")
    p.add_argument(
        "--calibration-images",
        default=None,
        help="folder of real images for the parity check, and with --int8 to calibrate (every other file) and gate "
        "on (the rest; sub-folders named as the labels add an accuracy check); default: none (a checkpoint's "
        "dataset when it is at hand)",
    )
    _add_int8_arguments(p)
    p.add_argument("--weights", default=None, help="with --arch: a state dict to load")
    p.add_argument(
        "--input-size", type=_size, default=None, help="SIZE or HxW; with --arch: a smaller input for speed runs"
    )
    p.add_argument("--labels", default=None, help="outside models: labels file (one per line, or a JSON list)")
    p.add_argument("--mean", type=_floats, default=None, help="outside models: mean per channel (default: ImageNet)")
    p.add_argument("--std", type=_floats, default=None, help="outside models: std per channel (default: ImageNet)")
    p.add_argument("--layout", default="nchw", choices=["nchw", "nhwc"], help="outside models: float input layout")
    p.add_argument("--resize-size", type=int, default=None, help="outside models: shorter side before the crop")
    p.add_argument(
        "--task", default="classify", choices=list(TASKS), help="outside models: what the outputs mean; "
        "default: classify",
    )  # fmt: skip
    p.add_argument(
        "--output-layout", default=None, choices=list(LAYOUTS),
        help="outside detectors (--task detect): yolo (ultralytics' raw [N, 4+C, A], either orientation), yolov5 "
        "(objectness column), end2end ([N, K, 6] rows, suppressed by the graph), efficientnms (TensorRT's num_dets, "
        "det_boxes, det_scores, det_classes) or candidates; required with --task detect",
    )  # fmt: skip
    p.add_argument(
        "--resize", default=None, choices=["center_crop", "letterbox", "stretch"],
        help="outside models: how an image meets the input; default: letterbox for detectors, center_crop otherwise",
    )  # fmt: skip
    p.add_argument(
        "--pad-value", type=int, default=114, help="outside detectors: the letterbox's grey (0-255); default: 114"
    )
    p.add_argument(
        "--device",
        default="auto",
        help="device for the latency figures and the --int8 speed gate: auto, cpu, cuda, cuda:N",
    )
    p.add_argument("--no-latency", action="store_true", help="skip the latency figures")


def _add_int8_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--int8",
        action="store_true",
        help="also write model.int8.onnx (onnxruntime static quantization), only if on held-out images it agrees "
        "with fp32 on >= 99%% of top-1 answers and, where labels are known, loses <= 1 point of accuracy, and "
        "it is faster than model.onnx on --device (see --int8-min-speedup); default: off",
    )
    p.add_argument(
        "--int8-min-speedup",
        type=_min_speedup,
        default=0.05,
        help="with --int8: the fraction of fp32's median latency int8 must save at every batch size timed (1 and "
        "8) on --device (the CUDA execution provider for cuda, where onnxruntime has it); negative accepts any "
        "speed; default: 0.05 (int8 at most 0.95x fp32's time)",
    )
    p.add_argument(
        "--int8-min-map", type=float, default=0.95,
        help="with --int8, a detector: the least mAP@0.5 of int8's boxes with fp32's as the truth, on held-out "
        "images; default: 0.95",
    )  # fmt: skip
    p.add_argument(
        "--int8-allow-slower",
        action="store_true",
        help="with --int8: write it even when it is not faster than fp32, with a warning and the figures, marked "
        'in spec.json (precision = "auto" then keeps fp32); default: off',
    )
    p.add_argument(
        "--int8-ungated",
        action="store_true",
        help="with --int8: write it whatever the gate says, marked ungated in spec.json (speed work on models "
        "whose predictions mean nothing, e.g. initial weights); default: off",
    )
    p.add_argument(
        "--int8-method",
        default="auto",
        choices=["auto", "minmax", "percentile", "entropy"],
        help="INT8 calibration method; auto measures minmax and percentile (entropy too if both miss) and keeps "
        "the one that agrees best with fp32; default: auto",
    )
    p.add_argument(
        "--int8-exclude",
        default="",
        help="comma-separated ONNX node names to keep in float in the INT8 model; default: none (the input's "
        "normalising front is always kept in float)",
    )


def _min_speedup(text: str) -> float:
    from export.quantize import check_min_speedup

    try:
        value = float(text)
        check_min_speedup(value)
    except (ValueError, ConfigError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _check_outside(args: argparse.Namespace) -> None:
    """An outside model's description, before torch is imported."""
    if not args.labels:
        raise ConfigError("--labels is required with --onnx or --torchscript")
    if args.input_size is None:
        raise ConfigError("--input-size is required with --onnx or --torchscript (e.g. 224 or 224x224)")
    if task_named(args.task).layouts and args.output_layout is None:
        raise ConfigError(f"--task {args.task} needs --output-layout ({', '.join(LAYOUTS)})")
    if not task_named(args.task).layouts and args.output_layout is not None:
        readers = " or ".join(name for name, task in TASKS.items() if task.layouts)
        raise ConfigError(f"--output-layout is for detectors: add --task {readers}")


def print_report(report: ExportReport) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=sys.stdout, width=max(shutil.get_terminal_size((140, 24)).columns, 120))
    title = f"export {report.name} version {report.version}" + (f", opset {report.opset}" if report.opset else "")
    table = Table(title=title)
    for column in ("artifact", "size", "export", "parity", "latency per batch (ms) on " + report.device, "written"):
        table.add_column(column)
    for a in report.artifacts:
        latency = ", ".join(f"{n}: {ms:.2f}" for n, ms in a.latency_ms.items()) or "-"
        table.add_row(
            f"{a.file} ({a.format} {a.precision})",
            f"{a.size_bytes / 1e6:.2f} MB",
            f"{a.export_s:.1f} s",
            a.parity.describe().split(":")[0] + (f" {a.parity.max_rel_error:.1e}" if a.parity.checked else ""),
            latency,
            "yes" if a.written else "NO",
        )
    console.print(table)
    for a in report.artifacts:
        console.print(f"parity {a.file}: {a.parity.describe()}", soft_wrap=True)
    for note in report.notes:
        console.print(f"note: {note}")
    if report.spec is not None:
        console.print(f"wrote {report.path} (spec.json records each artifact's parity)")
    else:
        console.print("nothing was written: no artifact passed its parity check")


def run_export(args: argparse.Namespace) -> int:
    # Refusals that need only the arguments come first: these before torch is imported, the request's own checks
    # before any model is built or image read (a bad --formats was refused only after the model was built and, for a
    # checkpoint, its validation images loaded).
    if args.onnx or args.torchscript:
        _check_outside(args)
    elif args.arch and args.input_size is not None and args.input_size[0] != args.input_size[1]:
        raise ConfigError("--input-size with --arch takes one SIZE (square inputs)")

    from rich.console import Console

    from export import exporter, outside, sources

    # Each of ExportRequest's fields from the flag of its name, the comma-separated ones split.
    given = {f: getattr(args, f) for f in exporter.ExportRequest.__struct_fields__ if hasattr(args, f)}
    listed = {
        f: tuple(n.strip() for n in given[f].split(",") if n.strip())
        for f in ("formats", "aoti_devices", "int8_exclude")
    }
    int8 = args.int8 or args.int8_ungated or args.int8_allow_slower
    request = exporter.ExportRequest(**{**given, **listed, "int8": int8, "latency": not args.no_latency})
    exporter.check_request(request)
    err = Console(stderr=True)

    def progress(message: str) -> None:
        if not args.no_progress:
            err.print(f"[dim]... {message}[/dim]")

    if args.onnx or args.torchscript:
        report = outside.place_outside_model(
            onnx_path=args.onnx,
            torchscript_path=args.torchscript,
            request=request,
            labels=outside.read_labels(args.labels),
            description=outside.described(args),
            calibration=args.calibration_images,
            progress=progress,
            int8_data=_int8_source(args),
        )
    else:
        if args.checkpoint:
            source = sources.from_checkpoint(args.checkpoint)
        else:
            size = args.input_size[0] if args.input_size else None
            source = sources.from_architecture(args.arch, weights=args.weights, input_size=size)
        if args.calibration_images:
            images = sources.calibration_images(args.calibration_images, source.spec)
            described = f"{len(images)} images from {args.calibration_images} and random uint8 batches"
            source = dataclasses.replace(source, real_images=images, real_source=described)
        report = exporter.export_source(source, request, progress=progress, int8_data=_int8_source(args))
    print_report(report)
    return 0 if report.ok else 1


def _int8_source(args: argparse.Namespace) -> Int8Source | None:
    """Where --int8 takes its images: the folder given, else the checkpoint's dataset, else (ungated only)
    generated ones; None without --int8, or when nothing fits (the export then says what to pass)."""
    if not (args.int8 or args.int8_ungated or args.int8_allow_slower):
        return None
    from export import calibration
    from models.checkpoint import load_checkpoint

    folder = args.calibration_images
    if folder:
        return lambda spec: calibration.from_folder(folder, spec)
    record = load_checkpoint(args.checkpoint).record if args.checkpoint else None
    if record is not None and record.detection is not None:  # a detector's: the generator it trained on
        params = record.detection.generator
        return lambda spec: calibration.from_canvases(params, spec)
    if record is not None:
        dataset = record.dataset

        def from_dataset(spec: ModelSpec) -> Int8Data:
            try:
                return calibration.from_dataset(dataset, spec)
            except DatasetError as exc:
                if not args.int8_ungated:
                    raise ConfigError(f"--int8: the checkpoint's dataset is not at hand ({exc}); pass "
                                      "--calibration-images DIR") from exc  # fmt: skip
                return calibration.from_samples(spec)

        return from_dataset
    if args.int8_ungated:
        return calibration.from_samples
    return None
