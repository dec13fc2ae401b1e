"""INT8 on the CPU: speed against fp32 onnxruntime, and the agreement gate on models trained here.

    .venv/bin/python scripts/int8_bench.py

Speed: resnet18 (initial weights, ``--size`` px) exported with ``--int8-ungated`` (initial weights give flat logits,
so agreement with fp32 is noise and no gate can pass), then fp32 ``model.onnx`` and ``model.int8.onnx`` run with the
server's own onnxruntime runtime, in turns (``--rounds`` alternating slices per batch size, so a shared machine's
drifting load falls on both alike), printing images/s per batch size and the ratio.

Gate: resnet18 trained on the digits upscaled to ``--train-size`` px for ``--epochs`` epochs, and the embedded
smallcnn trained 4 epochs, each exported with ``--int8`` (calibrated on the training split, gated on the validation
split): top-1 agreement with fp32, both accuracies, and whether the gate passed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=224, help="resnet18 input size for the speed run; default: 224")
    p.add_argument("--batch-sizes", default="1,8", help="comma-separated batch sizes; default: 1,8")
    p.add_argument("--seconds", type=float, default=8.0, help="measuring time per runtime and batch size; default: 8")
    p.add_argument("--rounds", type=int, default=4, help="alternating slices per batch size; default: 4")
    p.add_argument("--threads", type=int, default=0, help="onnxruntime intra-op threads; default: 0 (its own)")
    p.add_argument("--epochs", type=int, default=3, help="resnet18 training epochs on digits; default: 3")
    p.add_argument("--train-size", type=int, default=32, help="digits upscaled to this for resnet18; default: 32")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: speed, resnet18, smallcnn; default: none")
    p.add_argument("--work", default=None, help="folder for repositories and checkpoints; default: a temporary one")
    return p


def speed(work: Path, args: argparse.Namespace) -> None:
    from export import calibration
    from export.exporter import ExportRequest, export_model
    from export.sources import from_architecture
    from service.runtime import OnnxRuntime

    source = from_architecture("resnet18", input_size=args.size)
    request = ExportRequest(
        name="resnet18", repository=str(work / "speed"), formats=("onnx",), latency=False, int8=True,
        int8_ungated=True, int8_method="minmax",
    )  # fmt: skip
    started = time.perf_counter()
    report = export_model(source.eager, source.spec, request, int8_data=calibration.from_samples)
    int8 = next(a for a in report.artifacts if a.precision == "int8")
    print(f"resnet18 {args.size}x{args.size}: export + int8 in {time.perf_counter() - started:.1f} s; int8 quantize "
          f"{int8.export_s:.1f} s; {int8.parity.describe()}")  # fmt: skip
    folder = report.path
    threads = args.threads or None
    runtimes = {
        "fp32": OnnxRuntime(source.spec, folder / "model.onnx", threads=threads),
        "int8": OnnxRuntime(source.spec, folder / "model.int8.onnx", threads=threads),
    }
    import numpy as np

    try:
        rng = np.random.default_rng(0)
        for size in (int(b) for b in args.batch_sizes.split(",")):
            batch = rng.integers(0, 256, (size, 3, args.size, args.size), dtype=np.uint8)
            done = dict.fromkeys(runtimes, 0)
            spent = dict.fromkeys(runtimes, 0.0)
            for runtime in runtimes.values():
                runtime.run(batch)  # warm-up
            order = list(runtimes)
            for r in range(args.rounds):
                for name in order if r % 2 == 0 else order[::-1]:
                    t0 = time.perf_counter()
                    while True:
                        done[name] += len(runtimes[name].run(batch))
                        if time.perf_counter() - t0 >= args.seconds / args.rounds:
                            break
                    spent[name] += time.perf_counter() - t0
            rate = {k: done[k] / spent[k] for k in runtimes}
            print(f"  batch {size:>2}: fp32 {rate['fp32']:7.1f} images/s, int8 {rate['int8']:7.1f} images/s, "
                  f"int8/fp32 {rate['int8'] / rate['fp32']:.2f}x")  # fmt: skip
    finally:
        for runtime in runtimes.values():
            runtime.close()


def gate(work: Path, arch: str, epochs: int, input_size: int | None) -> None:
    from export import calibration
    from export.exporter import ExportRequest, export_model
    from export.sources import from_checkpoint
    from models.train import TrainConfig, train

    checkpoint = work / f"{arch}.pt"
    started = time.perf_counter()
    train(TrainConfig(arch=arch, epochs=epochs, input_size=input_size, out=str(checkpoint)))
    trained_s = time.perf_counter() - started
    source = from_checkpoint(checkpoint)
    request = ExportRequest(name=arch, repository=str(work / "gate"), formats=("onnx",), latency=False, int8=True)
    report = export_model(
        source.eager, source.spec, request, real_images=source.real_images,
        int8_data=lambda spec: calibration.from_dataset("digits", spec),
    )  # fmt: skip
    int8 = next(a for a in report.artifacts if a.precision == "int8")
    size = source.spec.input.height
    print(f"{arch} on digits at {size}x{size}, {epochs} epochs (trained in {trained_s:.0f} s): int8 "
          f"{'WRITTEN' if int8.written else 'REFUSED'}; {int8.parity.describe()}")  # fmt: skip
    record = int8.parity.record  # type: ignore[union-attr]
    print(f"  methods tried (agreement on the calibration images): {record.methods_tried}; quantize "
          f"{record.quantize_s:.1f} s")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    with tempfile.TemporaryDirectory(prefix="int8-bench-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        if "speed" not in skip:
            speed(work, args)
        if "resnet18" not in skip:
            gate(work, "resnet18", args.epochs, args.train_size)
        if "smallcnn" not in skip:
            gate(work, "smallcnn", 4, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
