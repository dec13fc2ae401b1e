"""A detector served against its in-process pipeline, with its answers checked (issue 44's served target).

Each round measures ``visionserve bench``'s detection pipeline in its own process (decode, letterbox, forward,
suppression, mapping; no HTTP, batch 8), then serves the model alone (service/launcher.py) and runs the load
tester's closed loop against ``/v1/models/M/detect`` at ``--concurrency`` clients with each
``--images-per-request``: served images/s and their ratio to that round's pipeline figure. Every served answer
kept is checked (:mod:`loadtest.answers`: a detection matches a box at IoU >= 0.5 with its label) against the
in-process pipeline's answers on the same images (``served``: the share that match, all of them unless serving
changed an answer) and against the boxes the images were made with (``known``: held-out digit canvases,
models/canvases.py; the model's own accuracy, with its recall and precision). Rounds alternate in-process and
served, so a shared machine's drift falls on both; the medians are the figures.

    visionserve bench detect --repository examples/model_repository --model digits-detect --rounds 3

Target: served at c=8 with 8 images a request >= 0.9 of the in-process pipeline (the ratio at one image a request
is printed, not judged). docs/performance.md, "Detection", holds the figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from loadtest.answers import check, write_reference
from loadtest.inputs import payloads
from loadtest.step import StepSpec
from service import launcher
from service.bench import kit
from service.bench.kit import COUNT, POSITIVE, VERDICT, Flag, bounds, conclude, header, one_step, step_figures
from service.core.arguments import comma_ints

TARGET = 0.9  # served at c=8, 8 images a request, against the in-process pipeline
PIPELINE_BATCH = 8
FLAGS: list[Flag] = [
    ("--repository", "model_repository", "model repository holding the detector"),
    ("--model", "digits-detect", "detector to measure"),
    ("--concurrency", 8, "closed-loop clients", COUNT),
    ("--images-per-request", (8, 1), "images in each request, one step each (the first is judged)", comma_ints),
    ("--rounds", 3, "rounds of in-process then served; the medians are reported", COUNT),
    ("--duration-s", 10.0, "measured seconds per served step", POSITIVE),
    ("--warmup-s", 2.0, "warm-up seconds per served step"),
    ("--bench-seconds", 5.0, "in-process pipeline: measuring seconds", POSITIVE),
    ("--canvases", 64, "held-out digit canvases served and benched", COUNT),
    ("--scale", 4, "canvases upscaled this many times (96 px: 384 px JPEGs)", COUNT),
    ("--check-answers", 2000, "requests a step whose answers are kept and checked", COUNT),
    ("--workers", None, "front ends (default: the server's choice)", int),
    ("--json", None, "write every figure to this file (default: print only)"),
]


def in_process(args: argparse.Namespace, images: Path) -> dict[str, Any]:
    """``visionserve bench``'s detection pipeline at batch 8 on ``images``, in a process of its own."""
    return kit.in_process(args, images, "pipeline", str(PIPELINE_BATCH))


def served_step(args: argparse.Namespace, url: str, bodies: list[Any], references: dict[str, Any]) -> dict[str, Any]:
    """One closed-loop step: images/s, latency, errors and the answers checked against each of ``references``."""
    where = bounds(url, args.warmup_s, args.duration_s, keep_answers=args.check_answers)
    step = one_step(args.model, bodies, StepSpec("closed", concurrency=args.concurrency), where)
    answers = {name: check(step.answers, reference).summary() for name, reference in references.items()}
    mean_batch = step.server.get("mean_batch_size") if step.server else None
    return step_figures(step) | {"mean_batch_size": mean_batch, "answers": answers}


def main(args: argparse.Namespace) -> int:
    from service.bench.detect import canvas_corpus, in_process_answers
    from service.core.repository import ModelRepository
    from service.core.tasks import Detect, task_for

    began = time.perf_counter()
    entry = ModelRepository(args.repository).model(args.model)
    if not isinstance(task_for(entry.latest.spec), Detect):
        print(f"{args.model} is not a detector (task {entry.latest.spec.task!r})", file=sys.stderr)
        return 2
    task = entry.latest.spec.task  # a segmenter's answers are checked on their boxes
    scratch = Path(tempfile.mkdtemp(prefix="vs-detect-bench-"))
    corpus = canvas_corpus(args.canvases, args.scale)
    (scratch / "images").mkdir()
    for name, data in zip(corpus.names, corpus.images, strict=True):
        (scratch / "images" / name).write_bytes(data)
    references = {
        "served": in_process_answers(args.repository, args.model, corpus.names, corpus.images),
        "known": corpus.known,
    }
    for name, reference in references.items():  # for `visionserve loadtest --reference` by hand
        write_reference(scratch / f"reference-{name}.json", reference)
    config = (entry.path / "config.toml").read_text() if (entry.path / "config.toml").is_file() else ""
    repo = kit.repository(scratch / "repository", {args.model: ({entry.latest.version: entry.latest.path}, config)})
    results = header(model=args.model, canvases=args.canvases, scale=args.scale, concurrency=args.concurrency)
    rounds: list[dict[str, Any]] = results.setdefault("rounds", [])
    for r in range(args.rounds):
        limit = in_process(args, scratch / "images")
        pipeline = limit["pipeline_images_per_s"]
        row: dict[str, Any] = {"pipeline_images_per_s": pipeline, "in_process": limit, "served": {}}
        share = limit.get("postprocess_share")
        post = f"; suppression + mapping {100 * share:.1f}% of the forward" if share is not None else ""
        print(f"round {r + 1}: in-process pipeline {pipeline:.1f} images/s (batch {PIPELINE_BATCH}{post})")
        with launcher.start(repo, workers=args.workers, log=scratch / f"server-{r}.log") as server:
            for per in args.images_per_request:
                bodies = payloads(args.model, corpus.images, per_request=per, task=task, names=corpus.names)
                step = row["served"][str(per)] = served_step(args, server.url, bodies, references)
                step["of_pipeline"] = step["images_per_s"] / pipeline
                a, known = step["answers"]["served"], step["answers"]["known"]
                print(f"  c={args.concurrency}, {per} images a request: {step['images_per_s']:.1f} images/s = "
                      f"{step['of_pipeline']:.3f} of the pipeline, p50 {step['p50_ms']:.1f} ms, p99 "
                      f"{step['p99_ms']:.1f} ms, mean batch {step['mean_batch_size'] or 0:.1f}, errors "
                      f"{sum(step['errors'].values())}; {a['images']} answers checked: "
                      f"{100 * a['share_matching']:.1f}% match the in-process ones; against the known boxes "
                      f"recall {100 * (known['recall'] or 0):.1f}%, precision {100 * (known['precision'] or 0):.1f}%",
                      flush=True)  # fmt: skip
        rounds.append(row)
    results["median"] = medians(rounds, args.images_per_request)
    judged = str(args.images_per_request[0])
    ratio = results["median"]["of_pipeline"][judged]
    met = ratio >= TARGET if args.concurrency == 8 and judged == "8" else None
    results["passed"] = met
    m = results["median"]
    each = [f"{per} a request {m['images_per_s'][per]:.1f} images/s = {m['of_pipeline'][per]:.3f} of it "
            f"({100 * m['share_matching'][per]:.1f}% answers as in process)" for per in m["of_pipeline"]]  # fmt: skip
    print(f"median of {args.rounds} rounds: pipeline {m['pipeline_images_per_s']:.1f} images/s; " + "; ".join(each)
          + f" [{VERDICT[met]}: >= {TARGET} at c=8, 8 a request]")  # fmt: skip
    return conclude(results, began, args.json)


def medians(rounds: list[dict[str, Any]], per_request: tuple[int, ...]) -> dict[str, Any]:
    """The median over rounds of the pipeline figure, and per images-a-request of served images/s, their ratio to
    the same round's pipeline, and the share of answers matching the in-process ones."""
    keys = [str(p) for p in per_request]
    return {
        "pipeline_images_per_s": statistics.median(r["pipeline_images_per_s"] for r in rounds),
        "images_per_s": {k: statistics.median(r["served"][k]["images_per_s"] for r in rounds) for k in keys},
        "of_pipeline": {k: statistics.median(r["served"][k]["of_pipeline"] for r in rounds) for k in keys},
        "share_matching": {
            k: statistics.median(r["served"][k]["answers"]["served"]["share_matching"] for r in rounds) for k in keys
        },
    }
