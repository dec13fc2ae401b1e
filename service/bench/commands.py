"""``visionserve bench``: ``engine`` (the engine in-process, the default: ``visionserve bench --model M``) and each
served scenario. Every scenario module holds ``FLAGS`` (a table, :func:`service.bench.kit.add_flags`) and
``main(args) -> int``; heavy imports wait until one runs."""

from __future__ import annotations

import argparse
import importlib
import io
import json
import sys
from collections.abc import Sequence
from typing import Any

from service.bench.flags import FIGURES
from service.bench.kit import Flag, add_flags
from service.core.arguments import HelpFormatter, comma_ints

LEVELS = ("debug", "info", "warning", "error")
# name -> (module, help)
SCENARIOS: dict[str, tuple[str, str]] = {
    "engine": ("service.bench.commands", "the engine in-process: runtime, decode pipeline, batcher (the default)"),
    "many-models": ("service.bench.many_models", "many on-demand models on one device against their targets"),
    "rollout": ("service.bench.rollout.run", "a candidate version beside the serving one against the targets"),
    "stream": ("service.bench.stream", "streams against their targets: bounded age, nothing lost, fairness"),
    "soak": ("service.bench.soak", "a long open loop at 80%% of capacity with bad inputs, judged aged vs fresh"),
    "ab": ("service.bench.ab", "two server configurations under the same load, in alternating rounds"),
    "frontends": ("service.bench.frontends", "served throughput and CPU per request against the engine's limit"),
    "detect": ("service.bench.detect_served", "a detector served at c=8 against its in-process pipeline, checked"),
    "sources": ("service.bench.sources", "RTSP cameras the server pulls into a detector: answered fps, fairness, age"),
    "transport": ("service.bench.transport", "the transport alone: shared-memory round trips between processes"),
    "track": ("service.bench.track", "tracking and line counts on ten clips of digits against their truth"),
    "train": ("service.bench.train", "training from image folders: throughput, loader, memory, fine-tuning"),
    "gpu-check": ("service.bench.gpu_check", "every GPU path, in steps, one report (make gpu-check)"),
    "gpu-speed": ("service.bench.gpu_speed", "resnet50 served on a GPU beside its limit and LitServe (make gpu-speed)"),
}


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.description = "Measure the engine in-process, or a served scenario against its targets."
    sub = p.add_subparsers(dest="scenario", metavar="SCENARIO")
    for name, (module_name, help_text) in SCENARIOS.items():
        module = importlib.import_module(module_name) if name != "engine" else sys.modules[__name__]
        q = sub.add_parser(name, help=help_text, description=module.__doc__, formatter_class=HelpFormatter)
        # Given after the scenario's name too; SUPPRESS keeps a value given before it.
        q.add_argument("--no-progress", action="store_true", default=argparse.SUPPRESS, help="no progress lines")
        q.add_argument("--log-level", choices=LEVELS, default=argparse.SUPPRESS, help="logging (default: warning)")
        if name == "engine":
            q.add_argument("--model", required=True, help="model name in the repository")
        add_flags(q, module.FLAGS)
        q.set_defaults(_scenario=module.main)
    parse = p.parse_known_args

    # `visionserve bench --model M` predates the scenarios: no scenario named means the engine's.
    def with_engine(args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        words = list(args or [])
        k = 0
        while k < len(words) and (words[k] in ("--no-progress", "--log-level") or words[k].startswith("--log-level=")):
            k += 2 if words[k] == "--log-level" else 1
        if k >= len(words) or words[k] not in (*SCENARIOS, "-h", "--help"):
            words.insert(0, "engine")
        return parse(words, namespace)

    p.parse_known_args = with_engine  # type: ignore[method-assign, assignment]


def run_bench(args: argparse.Namespace) -> int:
    if isinstance(sys.stdout, io.TextIOWrapper):  # each figure printed as it comes, under a pipe too
        sys.stdout.reconfigure(line_buffering=True)
    return int(args._scenario(args))


def _names(allowed: Sequence[str]) -> Any:
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(n.strip() for n in text.split(",") if n.strip())
        if not names or any(n not in allowed for n in names) or len(set(names)) != len(names):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(allowed)}, got {text!r}")
        return names

    return parse


PRECISIONS = ("fp32", "fp16", "bf16", "int8")
BACKENDS = ("onnxruntime", "torchscript", "aoti")
FLAGS: list[Flag] = [
    ("--repository", "model_repository", "model repository folder"),
    ("--device", "auto", "auto, cpu, cuda or cuda:N"),
    (
        "--backend",
        None,
        "one of, or a comma-separated list of, " + ", ".join(BACKENDS) + " to compare (default: config.toml's)",
        _names(BACKENDS),
    ),
    ("--precision", None, "fp16/bf16 on GPU, int8 (onnxruntime) anywhere (default: config.toml's)", PRECISIONS),
    ("--cuda-graphs", "on", "torch runtimes on CUDA: a graph per batch bucket", ("on", "off")),
    (
        "--figures",
        FIGURES,
        "which: engine, pipeline (a detector's: with suppression and mapping), decode (CPU pool vs nvJPEG), batcher, "
        "fake, candidates (a detector: suppression at 1,000 candidates an image)",
        _names(FIGURES),
    ),
    ("--batch-sizes", (1, 8, 32), "batch sizes; the largest is the maximum", comma_ints),
    ("--seconds", 5.0, "measuring time per figure"),
    ("--concurrency", None, "batcher submitters (default: 2 x largest batch)", int),
    ("--images", None, "folder of images to decode (default: generated 500x375 JPEGs)"),
    ("--json", False, "print one JSON object, progress to stderr"),
]


# Each line of the engine's report that the result holds (its key there), formatted from the result and the few
# words _print_run adds to it.
RUN_LINES = [
    ("decode_cpu_images_per_s", "  decode, CPU pool: {decode_cpu_images_per_s:.1f} images/s; nvJPEG: {nvjpeg}"),
    ("pipeline_images_per_s", "  pipeline ({stages}, batch {largest}): {pipeline_images_per_s:.1f} images/s"),
    (
        "postprocess_ms_per_image",
        "    of which per image: forward {compute_ms_per_image:.3f} ms, suppression + mapping "
        "{postprocess_ms_per_image:.3f} ms = {postprocess_share:.1%} of the forward ({candidates_per_image:.0f} "
        "candidates, {above_threshold_per_image:.1f} above the score threshold, {detections_per_image:.1f} kept)",
    ),
    (
        "answer_ms_per_image",
        "    the server's whole answer (the task's postprocess: suppression, mapping, a segmenter's masks as RLE; the "
        "rows): {answer_ms_per_image:.3f} ms = {answer_share:.1%} of the forward",
    ),
    (
        "yolo_seg",
        "  a YOLO-seg head (640 input, 80 classes, 32 prototypes of 160 x 160, {yolo_seg[instances_per_image]:.0f} "
        "instances): the answer {yolo_seg[answer_ms_per_image]:.2f} ms/image (target <= 8 ms), "
        "{yolo_seg[answer_kb_per_image]:.1f} KB as JSON (target < 20 KB)",
    ),
    ("at_skipped", "  at 1,000 candidates: skipped ({at_skipped})"),
    (
        "at",
        "  at {at[candidates_per_image]:.0f} candidates (the graph's TopK raised): pipeline "
        "{at[pipeline_images_per_s]:.1f} images/s, forward {at[compute_ms_per_image]:.3f} ms/image\n"
        "    suppression + mapping, the model's candidates: {at[model][postprocess_ms_per_image]:.3f} ms/image = "
        "{at[model][postprocess_share]:.1%} of the forward beside the decoding threads; its own CPU time "
        "{at[model][postprocess_cpu_ms_per_image]:.3f} ms = {at[model][postprocess_cpu_share]:.1%} "
        "({at[model][above_threshold_per_image]:.1f} above the threshold; target <= 5%)\n"
        "    suppression + mapping, dense candidates: {at[dense][postprocess_ms_per_image]:.3f} ms/image = "
        "{at[dense][postprocess_share]:.1%} of the forward ({at[dense][above_threshold_per_image]:.0f} above the "
        "threshold; target <= 5%)\n"
        "  a YOLO head (640 input, 80 classes, 8,400 anchors, {at[yolo][above_threshold]:.0f} above 0.25): decode + "
        "suppression {at[yolo][decode_suppress_ms_per_image]:.3f} ms/image (target <= 3 ms)",
    ),
    (
        "pipeline_gpu_decode_images_per_s",
        "  pipeline with GPU JPEG decode: {pipeline_gpu_decode_images_per_s:.1f} images/s",
    ),
    (
        "batcher_images_per_s",
        "  batcher ({concurrency} submitters): {batcher_images_per_s:.1f} images/s, efficiency "
        "{batcher_efficiency:.3f} of the pipeline, mean batch {batcher_mean_batch_size:.1f}",
    ),
    ("fake_items_per_s", "  batcher alone (no-op runtime): {fake_items_per_s:.0f} items/s"),
]


def _print_run(out: Any, result: dict[str, Any]) -> None:
    gpu, at = result.get("decode_gpu_images_per_s"), result.get("at_1000")
    shown = result["device"].startswith("cuda") or result["precision"] == "int8"
    words = {
        "shown": f", {result['precision']}" if shown else "",
        "graphs": ", CUDA graphs" if result.get("cuda_graphs") else "",
        "nvjpeg": f"{gpu:.1f} images/s" if gpu is not None else f"skipped ({result.get('decode_gpu_skipped')})",
        "stages": "decode + letterbox + run + suppression" if "postprocess_ms_per_image" in result else "decode + run",
        "largest": max(result["batch_sizes"]),
    }
    if at:
        words["at_skipped" if "skipped" in at else "at"] = at.get("skipped", at)
    r = result | words
    lines = ["{model} v{version} on {device} ({runtime}{shown}{graphs})".format_map(r)]
    lines += [f"  engine, batch {n:>4}: {rate:10.1f} images/s" for n, rate in result["engine_images_per_s"].items()]
    lines += [line.format_map(r) for key, line in RUN_LINES if key in r]
    out.print("\n".join(lines))


def _print_compared(out: Any, compared: dict[str, Any], model: str) -> None:
    from rich.table import Table

    table = Table(title=f"engine images/s, {model} on {compared['device']} (in turns; ratio to the fastest)")
    table.add_column("batch")
    for result in compared["runs"]:
        table.add_column(result["runtime"], justify="right")
    table.add_column("fastest")
    ratios = compared["ratio_to_fastest"]
    for size in (str(b) for b in compared["batch_sizes"]):
        rates = [(r["engine_images_per_s"].get(size, 0.0), ratios[r["runtime"]].get(size, 0)) for r in compared["runs"]]
        cells = [f"{rate:.1f} ({ratio:.2f})" for rate, ratio in rates]
        table.add_row(size, *cells, compared["fastest"].get(size, "-"))
    out.print(table)


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from service.bench.engine import BenchOptions, compare_backends
    from service.bench.engine import run_bench as bench

    err = Console(stderr=True)
    backends: tuple[str, ...] = args.backend or ()
    same = ("model", "repository", "device", "batch_sizes", "seconds", "concurrency", "images", "precision", "figures")
    options = BenchOptions(
        **{k: getattr(args, k) for k in same},
        backend=backends[0] if len(backends) == 1 else None,
        cuda_graphs=args.cuda_graphs == "on",
    )
    say = None if args.no_progress else lambda m: err.print(f"[dim]... {m}[/dim]")
    out = Console(file=sys.stdout, width=max(Console().width, 100))
    result = compare_backends(options, backends, say=say) if len(backends) > 1 else bench(options, say=say)
    if args.json:
        print(json.dumps(result))
    elif len(backends) > 1:
        _print_compared(out, result, args.model)
    else:
        _print_run(out, result)
    return 0
