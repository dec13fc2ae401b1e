"""Rollouts against the issue's targets: a candidate version beside the serving one, compared on live requests
(docs/rollouts.md), measured on real server processes on 127.0.0.1.

The primary is ``--version-dir`` (the shipped digits model, trained: agreement means something on it) or, with
``--arch``, that architecture exported with its initial weights. The candidates are derived from it
(scripts/rollout/candidates.py) and measured offline first, with onnxruntime on the held-out stream: scikit-learn's
digits of the validation split training never saw (``--stream-images``), sent as PNGs. A copy (agrees on every image),
a candidate calibrated to disagree on ``--detect-disagreement`` of the stream, one calibrated to
``--promote-disagreement`` and a label permutation (disagrees on every image).

Capacity: the closed-loop throughput of a server without a rollout (``--capacity-clients`` clients of the load
tester for ``--capacity-s``), or ``--capacity``. Then, each printed PASS or MISS with its figures:

a. live latency: a server shadowing a copy at ``--shadow-fraction`` (auto off: it never decides) and a server with no
   rollout, both up, taking turns (AB, BA, ...) in ``--rounds`` open-loop windows of ``--window-s`` at ``--load`` and
   at ``--high-load`` x capacity; p50/p99 from each scheduled send, pooled per side. Targets: p99 with the shadow
   within ``--max-p99-ratio`` x without at both loads, and at ``--high-load`` shadow work shed (``comparison.shed`` >
   0) rather than live requests delayed;
b. detection, every request shadowed, the stream at ``--detect-rate`` (low enough that shadows are not shed): the
   ``--detect-disagreement`` candidate with auto off, sent at least ``--detect-samples``: the samples at which
   ``agreement_high`` first fell below ``--min-agreement``, and from which it stayed below to the run's end, both
   within ``--detect-max-samples``; the ``--promote-disagreement`` candidate with auto on: promoted (after
   ``--min-samples``), and after how many samples; the permuted one with auto on: aborted within ``--abort-within``
   samples;
c. promotion under load: an open loop at ``--load`` x capacity on a server shadowing a copy, promoted through
   ``POST /v2/models/{m}/rollout/promote`` at ``--promote-at`` of ``--promote-s``: every request sent answered 200,
   and version 2 answering afterwards.

``GET /v2/models/{m}/rollout`` is polled through every run (``--poll-s``, ``--latency-poll-s``) and its history
written. Each scenario's server starts from a repository of its own under ``--work`` (hard links), with the rollout
in its config.toml; logs there too. About 3-4 minutes on 2 cores with the defaults. Exit code 0 when every target
is met, 1 when one is missed, 2 on a usage error::

    .venv/bin/python scripts/rollout_bench.py --out runs/rollout-bench/result.json
    .venv/bin/python scripts/rollout_bench.py --dry-run     # the candidates and their offline agreement only
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollout import candidates, scenarios, traffic
from rollout.report import report

PARTS = ("latency", "detection", "promotion")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--version-dir", default=str(candidates.DIGITS_VERSION), help="the primary: a served ONNX version folder "
        "(default: the shipped digits model, %(default)s)")  # fmt: skip
    add("--arch", default=None, help="instead, this models.zoo architecture (resnet18, ...) exported with its initial "
        "weights at --input-size (default: none, --version-dir)")  # fmt: skip
    add("--input-size", type=int, default=64, help="--arch's square input (default: %(default)s)")
    add("--model", default="digits", help="the model's name in the repositories (default: %(default)s)")
    add("--parts", default=",".join(PARTS), help="which runs, comma-separated (default: %(default)s)")
    add("--dry-run", action="store_true", help="build and measure the candidates offline, start no server "
        "(default: off)")  # fmt: skip
    add("--model-config", default="", help="serving settings (TOML lines, e.g. 'threads = 1') in every server's "
        "config.toml, before its [rollout] table (default: none: the server's defaults)")  # fmt: skip
    add("--workers", type=int, default=1, help="front ends per server (default: %(default)s)")
    add("--admin-token", default="rollout-bench", help="the servers' --admin-token (default: %(default)s)")
    add("--stream-images", type=int, default=359, help="held-out digits in the stream; past the 359 of the "
        "validation split, training images follow (default: %(default)s)")  # fmt: skip
    add("--seed", type=int, default=0, help="seeds the label permutation (default: %(default)s)")
    add("--capacity", type=float, default=None, help="requests/s taken as capacity (default: measured)")
    add("--capacity-clients", type=int, default=8, help="closed-loop clients measuring capacity (default: "
        "%(default)s)")  # fmt: skip
    add("--capacity-s", type=float, default=5.0, help="counted seconds of the capacity run (default: %(default)s)")
    add("--shadow-fraction", type=float, default=0.1, help="shadowed share of requests in a and c (default: "
        "%(default)s)")  # fmt: skip
    add("--load", type=float, default=0.6, help="share of capacity in a and c (default: %(default)s)")
    add("--high-load", type=float, default=0.95, help="a's second load, where shadows are shed (default: %(default)s)")
    add("--rounds", type=int, default=2, help="a's rounds per load, each a window per server (default: %(default)s)")
    add("--window-s", type=float, default=8.0, help="seconds of one window in a (default: %(default)s)")
    add(
        "--max-ratio",
        type=float,
        default=1.05,
        help="target at --load: p50 and p99 with the shadow / without, each at most this (default: 1.05)",
    )
    add("--max-p99-ratio", type=float, default=1.10, help="target: p99 with the shadow / without, at most "
        "(default: %(default)s)")  # fmt: skip
    add("--min-agreement", type=float, default=0.99, help="the rollouts' min_agreement (default: %(default)s)")
    add("--min-samples", type=int, default=1000, help="the rollouts' min_samples before a promotion (default: "
        "%(default)s, the server's own)")  # fmt: skip
    add("--detect-disagreement", type=float, default=0.02, help="the detected candidate's disagreement on the stream "
        "(default: %(default)s)")  # fmt: skip
    add("--promote-disagreement", type=float, default=0.003, help="the promoted candidate's disagreement on the "
        "stream (default: %(default)s)")  # fmt: skip
    add("--detect-rate", type=float, default=150.0, help="requests/s in b (default: %(default)s)")
    add("--detect-max-samples", type=int, default=5000, help="target: the 2%% candidate detected within this many "
        "samples; b's runs stop there (default: %(default)s)")  # fmt: skip
    add("--detect-samples", type=int, default=2000, help="the detection run goes on past this many samples (while "
        "the interval excludes --min-agreement), to see whether it stays excluded (default: %(default)s)")  # fmt: skip
    add("--abort-within", type=int, default=200, help="target: the permuted candidate aborted within this many "
        "samples (default: %(default)s)")  # fmt: skip
    add("--promote-s", type=float, default=20.0, help="seconds of c's open loop (default: %(default)s)")
    add("--promote-at", type=float, default=0.5, help="share of --promote-s at which c promotes (default: "
        "%(default)s)")  # fmt: skip
    add("--poll-s", type=float, default=0.1, help="seconds between polls of the rollout route in b (default: "
        "%(default)s)")  # fmt: skip
    add("--latency-poll-s", type=float, default=1.0, help="seconds between polls in a and c, both servers alike "
        "(default: %(default)s)")  # fmt: skip
    add("--timeout-s", type=float, default=30.0, help="per-request timeout (default: %(default)s)")
    add("--work", default="runs/rollout-bench", help="candidates, repositories and logs (default: %(default)s)")
    add("--out", default=None, help="write every figure as JSON here (default: WORK/result.json)")
    return p


def usage_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags, or None."""
    parts = [x for x in args.parts.split(",") if x]
    if not parts or any(x not in PARTS for x in parts):
        return f"--parts takes a comma-separated subset of {', '.join(PARTS)}, got {args.parts!r}"
    counts = (args.workers, args.stream_images, args.capacity_clients, args.rounds, args.detect_max_samples,
              args.detect_samples, args.min_samples)  # fmt: skip
    if min(counts) < 1:
        return ("--workers, --stream-images, --capacity-clients, --rounds, --detect-max-samples, --detect-samples and "
                "--min-samples must be >= 1")  # fmt: skip
    if min(args.capacity_s, args.window_s, args.detect_rate, args.promote_s, args.poll_s, args.latency_poll_s) <= 0:
        return "--capacity-s, --window-s, --detect-rate, --promote-s, --poll-s and --latency-poll-s must be > 0"
    shares = (args.shadow_fraction, args.load, args.high_load, args.promote_at, args.min_agreement)
    if not all(0 < x <= 1 for x in shares) or (args.capacity is not None and args.capacity <= 0):
        return "--shadow-fraction, --load, --high-load, --promote-at, --min-agreement must be in (0, 1]; --capacity > 0"
    if not all(0 <= x < 1 for x in (args.detect_disagreement, args.promote_disagreement)):
        return "--detect-disagreement and --promote-disagreement must be in [0, 1)"
    return None


def primary_of(args: argparse.Namespace, work: Path) -> Path:
    if args.arch is None:
        return Path(args.version_dir)
    from manymodels.models import export_once

    return export_once(args.arch, args.input_size, 32, work / f"export-{args.arch}-{args.input_size}")


def build_candidates(args: argparse.Namespace, primary: Path, digits: candidates.Digits,
                     folder: Path) -> tuple[dict[str, Path], dict[str, Any]]:  # fmt: skip
    """The four candidates in ``folder`` and what each disagrees on offline (onnxruntime, the held-out stream)."""
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    built = {"copy": candidates.copy_version(primary, folder / "copy")}
    offline: dict[str, Any] = {}
    for name, target in (("detect", args.detect_disagreement), ("promote", args.promote_disagreement)):
        class_index, bias, measured = candidates.calibrate_disagreement(primary, digits.images, target)
        built[name] = candidates.bias_logits(primary, folder / name, class_index, bias)
        offline[name] = {"target": target, "class_index": class_index, "bias": bias, "disagreement": measured}
    perm = candidates.permute_labels(primary, folder / "permuted", args.seed)
    built["permuted"] = folder / "permuted"
    offline["permuted"] = {"permutation": perm}
    offline["copy"] = {}
    for name, path in built.items():
        offline[name]["disagreement"] = 1 - candidates.agreement(primary, path, digits.images)
        print(f"candidate {name:<8} disagrees offline on {offline[name]['disagreement']:7.2%} of "
              f"{len(digits.images)} held-out images", flush=True)  # fmt: skip
    return built, offline


def measure_capacity(args: argparse.Namespace, work: Path, primary: Path, pngs: list[bytes]) -> dict[str, Any]:
    if args.capacity is not None:
        return {"requests_per_s": args.capacity, "given": True}
    repo = scenarios.repository(args, work, "capacity", {1: primary})
    with traffic.start(repo, work / "logs" / "capacity.log", args) as server:
        found = traffic.capacity(server.url, args.model, pngs, args.capacity_clients, args.capacity_s, args.timeout_s)
    print(f"capacity: {found['requests_per_s']:.0f} requests/s closed loop ({args.capacity_clients} clients), p50 "
          f"{found['p50_ms']:.2f} ms, errors {found['errors'] or 0}", flush=True)  # fmt: skip
    return found


def run(args: argparse.Namespace, work: Path, results: dict[str, Any]) -> None:
    primary = primary_of(args, work)
    digits = candidates.held_out_digits(args.stream_images, primary)
    built, offline = build_candidates(args, primary, digits, work / "candidates")
    results.update(primary=str(primary), stream={"images": len(digits.images), "held_out": digits.held_out},
                   offline=offline)  # fmt: skip
    if args.dry_run:
        return
    parts = args.parts.split(",")
    requests = traffic.requests_for(args.model, digits.pngs)
    results["capacity"] = measure_capacity(args, work, primary, digits.pngs)
    rate = results["capacity"]["requests_per_s"]
    if "latency" in parts:
        print(f"a. live latency, {args.rounds} rounds of {args.window_s:g} s per server and load", flush=True)
        results["latency"] = scenarios.latency_runs(args, work, primary, built["copy"], requests, rate)
    if "detection" in parts:
        print(f"b. detection at {args.detect_rate:g} req/s, every request shadowed", flush=True)
        found = scenarios.detection(args, work, primary, built, requests)
        for name in ("detect", "promote"):
            found[name]["offline_disagreement"] = offline[name]["disagreement"]
        results["detection"] = found
    if "promotion" in parts:
        print(f"c. promotion under load: {args.load:.0%} of capacity for {args.promote_s:g} s", flush=True)
        results["promotion"] = scenarios.promotion(args, work, primary, built["copy"], requests, rate)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    error = usage_error(args)
    if error is not None:
        print(error, file=sys.stderr)
        return 2
    began = time.perf_counter()
    work = Path(args.work)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
        "model": args.model, "workers": args.workers,
        "limits": {"max_ratio": args.max_ratio, "max_p99_ratio": args.max_p99_ratio,
                   "min_agreement": args.min_agreement,
                   "detect_max_samples": args.detect_max_samples, "abort_within": args.abort_within},
    }  # fmt: skip
    run(args, work, results)
    results["wall_s"] = time.perf_counter() - began
    judged = [results[k]["passed"] for k in PARTS if k in results]
    results["passed"] = all(judged) if judged else None
    if not args.dry_run:
        report(results)
        print(f"verdict: {'every target met' if results['passed'] else 'a target missed'} "
              f"({results['wall_s']:.0f} s)")  # fmt: skip
    out = Path(args.out or work / "result.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str))
    print(f"wrote {out}")
    return 0 if results["passed"] is not False else 1


if __name__ == "__main__":
    sys.exit(main())
