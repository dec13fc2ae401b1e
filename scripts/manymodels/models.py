"""The models: one architecture exported once, copied with weights and labels of their own, and repositories of
hard-linked copies."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

BUILD_STAMP = "build.json"


def export_once(arch: str, input_size: int, max_batch_size: int, folder: Path) -> Path:
    """``arch`` with its initial weights exported to ONNX in ``folder`` (kept: a second call reuses it)."""
    version = folder / "source" / "1"
    if (version / "model.onnx").is_file() and (version / "spec.json").is_file():
        return version
    from export.exporter import ExportRequest, export_model
    from export.sources import from_architecture

    shutil.rmtree(folder, ignore_errors=True)
    source = from_architecture(arch, input_size=input_size)
    request = ExportRequest(name="source", repository=str(folder), version=1, formats=("onnx",), latency=False,
                            max_batch_size=max_batch_size)  # fmt: skip
    export_model(source.eager, source.spec, request)
    return version


def on_demand_config(max_batch_size: int, pinned: bool = False) -> str:
    return (f'residency = "{"pinned" if pinned else "on_demand"}"\nmax_batch_size = {max_batch_size}\n'
            "max_queue_delay_ms = 2.0\n")  # fmt: skip


def build_models(args: argparse.Namespace, work: Path) -> tuple[list[str], Path]:
    """``--models`` copies of one export, each with its own final-layer bias and labels (``m07/<label>``); reused
    when ``work`` holds the same build."""
    import msgspec
    import numpy as np
    import onnx
    from onnx import numpy_helper

    from service.core.spec import load_spec, write_spec

    names = [f"m{i:02d}" for i in range(args.models)]
    repo = work / "repository"
    stamp = {"arch": args.arch, "input_size": args.input_size, "models": args.models, "seed": args.seed,
             "max_batch_size": args.max_batch_size}  # fmt: skip
    if (work / BUILD_STAMP).is_file() and json.loads((work / BUILD_STAMP).read_text()) == stamp:
        return names, repo
    started = time.perf_counter()
    folder = work / f"export-{args.arch}-{args.input_size}"
    source = export_once(args.arch, args.input_size, args.max_batch_size, folder)
    model = onnx.load(str(source / "model.onnx"))
    spec = load_spec(source / "spec.json")
    gemm = [n for n in model.graph.node if n.op_type == "Gemm"][-1]  # the classifier: Linear exports as Gemm
    bias = next(i for i in model.graph.initializer if i.name == gemm.input[2])
    original = numpy_helper.to_array(bias).copy()
    shutil.rmtree(repo, ignore_errors=True)
    (work / BUILD_STAMP).unlink(missing_ok=True)
    rng = np.random.default_rng(args.seed)
    for name in names:
        version = repo / name / "1"
        version.mkdir(parents=True)
        moved = original + rng.normal(0.0, 1.0, original.shape).astype(original.dtype)  # outweighs initial logits
        bias.CopyFrom(numpy_helper.from_array(moved, bias.name))
        (version / "model.onnx").write_bytes(model.SerializeToString())
        own = msgspec.structs.replace(spec, name=name, labels=tuple(f"{name}/{label}" for label in spec.labels))
        write_spec(own, version / "spec.json")
        (repo / name / "config.toml").write_text(on_demand_config(args.max_batch_size))
    (work / BUILD_STAMP).write_text(json.dumps(stamp))
    print(f"built {len(names)} {args.arch} models ({args.input_size}x{args.input_size}) in {repo} in "
          f"{time.perf_counter() - started:.1f} s", flush=True)  # fmt: skip
    return names, repo


def linked_model(src: Path, dst: Path, config: str) -> None:
    """A model folder whose version files are hard links of ``src``'s, with a config of its own."""
    for file in src.glob("*/*"):
        (dst / file.parent.name).mkdir(parents=True, exist_ok=True)
        os.link(file, dst / file.parent.name / file.name)
    (dst / "config.toml").write_text(config)


def repository_of(root: Path, models: dict[str, tuple[Path, str]]) -> Path:
    shutil.rmtree(root, ignore_errors=True)
    for name, (src, config) in models.items():
        linked_model(src, root / name, config)
    return root
