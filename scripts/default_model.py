"""The embedded default model as the project ships it, made by the project's own ``train`` and ``export``.

smallcnn trained on scikit-learn's bundled digits with ``train``'s defaults (seed 0), exported to ONNX behind
``export``'s parity gate into ``examples/model_repository/digits`` (``1/model.onnx``, ``1/spec.json``, export's
default ``config.toml``), with the training record beside it (``training.json``). ``make serve`` serves a copy of
it with no torch installed; ``make default-model`` runs this script to make it again.

``--check`` trains again in a scratch folder and holds the shipped model to it: the new run's validation accuracy
within a point of the shipped record, the shipped ONNX model's own accuracy on the same validation split within a
point of its record, and its parity record within the gate (exit 1 otherwise).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "examples" / "model_repository"
POINT = 0.01  # "within a point" of accuracy
PARITY_MAX_REL_ERROR = 1e-4  # export's fp32 gate


def build(out: Path, work: Path, *, epochs: int | None = None) -> dict[str, Any]:
    """Train and export into ``out``/digits; the training record (what training.json holds)."""
    from export.exporter import ExportRequest, export_source
    from export.sources import from_checkpoint
    from models.config import TrainConfig
    from models.train import train

    checkpoint = work / "digits.pt"
    config = TrainConfig(out=str(checkpoint)) if epochs is None else TrainConfig(out=str(checkpoint), epochs=epochs)
    started = time.perf_counter()
    result = train(config)
    if (out / "digits").exists():
        shutil.rmtree(out / "digits")
    request = ExportRequest(name="digits", repository=str(out), formats=("onnx",), latency=False, version=1)
    report = export_source(from_checkpoint(checkpoint), request)
    if not report.ok:
        raise SystemExit(f"default_model: the export failed its parity gate: {report}")
    record = result.record
    training = {
        "architecture": config.arch, "dataset": config.dataset, "epochs": record.epochs, "seed": record.seed,
        "val_accuracy": record.val_accuracy, "best_val_accuracy": record.best_val_accuracy,
        "val_size": record.val_size, "train_s": round(time.perf_counter() - started, 1),
        "versions": record.versions, "created_at": record.created_at, "made_by": "make default-model",
    }  # fmt: skip
    (out / "digits" / "training.json").write_text(json.dumps(training, indent=2) + "\n")
    return training


def onnx_accuracy(model_dir: Path) -> float:
    """The shipped ONNX model's own top-1 accuracy on the training's validation split (the dataset's fixed split,
    preprocessed as training does), run by the serving runtime, as the server runs it."""
    import numpy as np

    from models.datasets import load_dataset
    from service.core.config import ModelConfig
    from service.core.repository import ModelRepository
    from service.runtime import make_runtime

    version = ModelRepository(model_dir.parent).model(model_dir.name).latest
    runtime = make_runtime(version, ModelConfig(), "onnxruntime", "cpu")
    try:
        data = load_dataset("digits", version.spec)
        logits = runtime.run(np.ascontiguousarray(data.val_images.numpy()))
        return float((logits.argmax(axis=1) == data.val_targets.numpy()).mean())
    finally:
        runtime.close()


def check(shipped: Path, work: Path) -> list[str]:
    """What is wrong with the shipped model against a fresh run (empty: nothing)."""
    recorded = json.loads((shipped / "digits" / "training.json").read_text())
    fresh = build(work / "repo", work, epochs=int(recorded["epochs"]))
    problems = []
    shipped_acc, fresh_acc = recorded["val_accuracy"], fresh["val_accuracy"]
    if abs(fresh_acc - shipped_acc) > POINT:
        problems.append(f"a fresh run reached {fresh_acc:.2%}, the shipped one {shipped_acc:.2%}")
    own = onnx_accuracy(shipped / "digits")
    if abs(own - shipped_acc) > POINT:
        problems.append(f"the shipped model.onnx scores {own:.2%}, its record says {shipped_acc:.2%}")
    spec = json.loads((shipped / "digits" / "1" / "spec.json").read_text())
    (onnx,) = [e for e in spec["exports"] if e["format"] == "onnx"]
    if not (onnx["parity_max_rel_error"] <= PARITY_MAX_REL_ERROR and onnx["parity_top1_agreement"] == 1.0):
        problems.append(f"the shipped spec.json's parity record is outside the gate: {onnx}")
    print(f"shipped {shipped_acc:.2%} (model.onnx itself {own:.2%}), fresh run {fresh_acc:.2%}")
    return problems


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser("default_model", description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--out", default=str(SHIPPED), help=f"repository to write into (default: {SHIPPED})")
    p.add_argument("--check", action="store_true", help="train again and hold the shipped model to it (default: off)")
    p.add_argument("--epochs", type=int, default=None, help="epochs (default: train's own)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="default-model-") as tmp:
        if args.check:
            problems = check(Path(args.out), Path(tmp))
            for problem in problems:
                print(f"default_model: {problem}", file=sys.stderr)
            return 1 if problems else 0
        record = build(Path(args.out), Path(tmp), epochs=args.epochs)
    print(f"wrote {args.out}/digits: validation accuracy {record['val_accuracy']:.2%} ({record['train_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
