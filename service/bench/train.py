"""Benchmark of training from image folders: the real ``visionserve train`` command, each run its own process.

Sections (``--only`` picks some):
  throughput  images/s, data-wait share and compute share with ``--workers 0`` against ``--workers N`` (streamed)
  loader      a small folder held in memory against streamed, several epochs (what ``--loader auto`` chooses)
  rss         peak resident memory streaming a folder of N images against one of 4N (the same step count)
  finetune    epochs to an accuracy on folder B from scratch and from weights trained on folder A (other classes)

Folders are generated with scripts/make_folder_dataset.py (500x375 JPEGs) under --work unless they exist; the
4N-image folder hard-links the N images four times (the file count is what matters for memory). Prints a line
per run, the load average around each section (other users of the machine skew the figures), and a JSON line.

    visionserve bench train --only throughput,rss
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from service import launcher
from service.bench.kit import ROOT, Flag

SECTIONS = ("throughput", "loader", "rss", "finetune")


FLAGS: list[Flag] = [
    ("--only", ",".join(SECTIONS), "sections, comma-separated"),
    ("--work", "/tmp/visionserve-train-bench", "folders and checkpoints"),
    ("--images", 5000, "images in the main folder"),
    ("--arch", "mobilenet_v3_small", "architecture"),
    ("--input-size", 64, "input size"),
    ("--batch-size", 32, "batch size"),
    ("--workers", None, "DataLoader workers for N (default: train's own default)", int),
    ("--batches", 40, "throughput and rss: batches per run"),
    ("--loader-images", 500, "loader: images in the small folder"),
    ("--loader-epochs", 3, "loader: epochs"),
    ("--pretrain-images", 1000, "finetune: folder A images"),
    ("--pretrain-epochs", 6, "finetune: epochs on folder A"),
    ("--finetune-images", 500, "finetune: folder B images"),
    ("--finetune-epochs", 6, "finetune: epochs on folder B"),
]


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def make_folder(path: Path, images: int, classes: int = 10, offset: int = 0, seed: int = 0) -> Path:
    if not path.is_dir():
        sizes = {"--images": images, "--classes": classes, "--class-offset": offset, "--seed": seed}
        flags = [str(word) for pair in sizes.items() for word in pair]
        subprocess.run(
            [sys.executable, "scripts/make_folder_dataset.py", "--out", str(path), *flags], check=True, cwd=ROOT
        )
    return path


def linked_copies(source: Path, target: Path, copies: int) -> Path:
    """``copies`` hard links of every image of ``source``, under new names: more files, no more disk."""
    if not target.is_dir():
        for cls in sorted(p for p in source.iterdir() if p.is_dir()):
            (target / cls.name).mkdir(parents=True)
            for image in cls.iterdir():
                for k in range(copies):
                    os.link(image, target / cls.name / f"{k}_{image.name}")
    return target


def peak_memory(proc: subprocess.Popen[bytes]) -> dict[str, float]:
    """Wait for ``proc``, sampling the summed RSS of it and its DataLoader workers every 0.2 s (shared pages counted
    once per process); with the peak RSS of its largest process, from wait4 (this run's alone)."""
    tree_peak_mb = 0.0
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return {"maxrss_mb": usage.ru_maxrss / 1024, "tree_peak_mb": tree_peak_mb}
        tree_peak_mb = max(tree_peak_mb, launcher.tree_rss_mb(proc.pid))
        time.sleep(0.2)


def train(
    args: argparse.Namespace,
    folder: Path,
    out: Path,
    *extra: str,
    measure: bool = False,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One ``visionserve train`` run; its record (and with ``measure`` its peak memory)."""
    sizes = ["--arch", args.arch, "--input-size", str(args.input_size), "--batch-size", str(args.batch_size)]
    where = ["--dataset", f"folder:{folder}", "--device", "cpu", "--out", str(out)]
    cmd = [sys.executable, "-m", "service.cli", "train", "--no-progress", *sizes, *where, *extra]
    started = time.perf_counter()
    result: dict[str, Any] = {}
    with tempfile.TemporaryFile() as err:  # a file: a pipe nobody reads while it runs could fill and stall it
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, env=env)
        if measure:
            result = peak_memory(proc)
        if proc.wait() != 0:
            err.seek(0)
            sys.exit(f"training failed: {' '.join(cmd)}\n{err.read().decode(errors='replace')[-3000:]}")
    from models.checkpoint import load_checkpoint

    record = load_checkpoint(out).record
    assert record is not None
    return {**result, "wall_s": time.perf_counter() - started, "record": record}


def throughput(args: argparse.Namespace, folder: Path, work: Path) -> dict[str, Any]:
    """``--workers 0`` and ``--workers N``; and ``--workers 0`` on as many compute threads as N leaves the loop
    (``train`` gives its threads the cores the workers do not use), to tell the loader's gain from the threads'."""
    from models.folder import default_workers

    n = args.workers if args.workers is not None else default_workers()
    threads = str(max(1, len(os.sched_getaffinity(0)) - n))
    rows: dict[str, dict[str, float]] = {}
    for label, workers, env in (
        ("0", 0, None),
        (f"0 ({threads} thread)", 0, {**os.environ, "OMP_NUM_THREADS": threads}),
        (str(n), n, None),
    ):
        extra = ("--epochs", "1", "--loader", "stream", "--workers", str(workers), "--limit-batches", str(args.batches))
        h = train(args, folder, work / f"tp{workers}.pt", *extra, env=env)["record"].history[0]
        busy = h.data_wait_s + h.compute_s
        rows[label] = {
            "images_per_s": h.images_per_s,
            "data_wait_share": h.data_wait_s / busy,
            "compute_share": h.compute_s / busy,
            "data_wait_s": h.data_wait_s,
            "compute_s": h.compute_s,
        }
        print(
            f"  --workers {label}: {h.images_per_s:.1f} images/s, data wait {h.data_wait_s:.1f} s "
            f"({h.data_wait_s / busy:.0%}), compute {h.compute_s:.1f} s ({h.compute_s / busy:.0%})"
        )
    speedup = rows[str(n)]["images_per_s"] / rows["0"]["images_per_s"]
    same_threads = rows[str(n)]["images_per_s"] / rows[f"0 ({threads} thread)"]["images_per_s"]
    print(f"  workers {n} against 0: {speedup:.2f}x images/s (target >= 1.3x); {same_threads:.2f}x on equal threads")
    return {"workers": n, "runs": rows, "speedup": speedup, "speedup_equal_threads": same_threads}


def loader(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    folder = make_folder(work / f"small{args.loader_images}", args.loader_images)
    rows = {}
    for mode in ("memory", "stream"):
        extra = ("--workers", str(args.workers)) if args.workers is not None else ()
        run = train(
            args, folder, work / f"loader-{mode}.pt", "--epochs", str(args.loader_epochs), "--loader", mode, *extra
        )
        rows[mode] = {"wall_s": run["wall_s"], "train_s": run["record"].duration_s}
        print(
            f"  {mode}: {args.loader_epochs} epochs in {run['record'].duration_s:.1f} s (process {run['wall_s']:.1f} s)"
        )
    return rows


def rss(args: argparse.Namespace, folder: Path, work: Path) -> dict[str, Any]:
    big = linked_copies(folder, work / f"linked{4 * args.images}", 4)
    rows = {}
    for name, path in ((str(args.images), folder), (str(4 * args.images), big)):
        extra = ("--epochs", "1", "--loader", "stream", "--limit-batches", str(args.batches))
        run = train(args, path, work / f"rss{name}.pt", *extra, measure=True)
        rows[name] = {"maxrss_mb": run["maxrss_mb"], "tree_peak_mb": run["tree_peak_mb"]}
        print(
            f"  {name} images: peak RSS {run['maxrss_mb']:.0f} MB (largest process), "
            f"{run['tree_peak_mb']:.0f} MB summed over the process and its workers"
        )
    growth = rows[str(4 * args.images)]["maxrss_mb"] / rows[str(args.images)]["maxrss_mb"] - 1
    print(f"  growth with 4x the images: {growth:+.1%} (target <= +15%)")
    return {"runs": rows, "growth": growth}


def finetune(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    a = make_folder(work / f"pretrainA{args.pretrain_images}", args.pretrain_images, classes=10, seed=1)
    b = make_folder(work / f"finetuneB{args.finetune_images}", args.finetune_images, classes=5, offset=10, seed=2)
    pre = train(args, a, work / "A.pt", "--epochs", str(args.pretrain_epochs))
    print(f"  folder A (10 classes): {pre['record'].val_accuracy:.1%} after {args.pretrain_epochs} epochs")
    curves = {}
    for name, extra in (("scratch", ()), ("finetune", ("--weights", str(work / "A.pt")))):
        run = train(args, b, work / f"B-{name}.pt", "--epochs", str(args.finetune_epochs), *extra)
        curves[name] = [h.val_accuracy or 0.0 for h in run["record"].history]
        print(f"  folder B (5 other classes), {name}: " + ", ".join(f"{v:.0%}" for v in curves[name]))
    target = max(curves["scratch"])
    reach = {k: next((i + 1 for i, v in enumerate(c) if v >= target), None) for k, c in curves.items()}
    print(f"  epochs to scratch's best ({target:.0%}): scratch {reach['scratch']}, fine-tuned {reach['finetune']}")
    return {"curves": curves, "target": target, "epochs_to_target": reach}


def main(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(ROOT))
    wanted = [s.strip() for s in args.only.split(",") if s.strip()]
    if any(s not in SECTIONS for s in wanted):
        print(f"--only takes {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    folder = make_folder(work / f"shapes{args.images}", args.images) if {"throughput", "rss"} & set(wanted) else None
    summary: dict[str, Any] = {
        "benchmark": "train-folder",
        "arch": args.arch,
        "input_size": args.input_size,
        "cores": len(os.sched_getaffinity(0)),
    }
    for section in wanted:
        print(f"{section} (load average before: {loadavg()})")
        if section in ("throughput", "rss"):
            assert folder is not None
            summary[section] = (throughput if section == "throughput" else rss)(args, folder, work)
        else:
            summary[section] = (loader if section == "loader" else finetune)(args, work)
        summary[section]["loadavg_after"] = loadavg()
        print(f"  (load average after: {loadavg()})")
    print(json.dumps(summary))
    return 0
