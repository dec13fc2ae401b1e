"""Rollouts against the issue's targets: a candidate version beside the serving one, compared on live requests
(docs/rollouts.md), measured on real server processes on 127.0.0.1.

The primary is ``--version-dir`` (the shipped digits model, trained: agreement means something on it) or, with
``--arch``, that architecture exported with its initial weights. The candidates are derived from it
(:mod:`.candidates`) and measured offline first, with onnxruntime on the held-out stream: scikit-learn's
digits of the validation split training never saw (``--stream-images``), sent as PNGs. A copy (agrees on every image),
a candidate calibrated to disagree on ``--detect-disagreement`` of the stream, one calibrated to
``--promote-disagreement`` and a label permutation (disagrees on every image).

Capacity: the closed-loop throughput of a server without a rollout (``--capacity-clients`` clients of the load
tester for ``--capacity-s``), or ``--capacity``. Then, each printed PASS or MISS with its figures:

a. live latency: a server shadowing a copy at ``--shadow-fraction`` (auto off: it never decides) and a server with no
   rollout, both up, taking turns (AB, BA, ...) in ``--rounds`` open-loop windows of ``--window-s`` at ``--load`` and
   at ``--high-load`` x capacity, each load sent to each server for ``--warmup-s`` first (not counted); p50/p99 from
   each scheduled send, pooled per side. Targets: p99 with the shadow within ``--max-p99-ratio`` x without at both
   loads, and at ``--high-load`` shadow work shed (``comparison.shed`` > 0) rather than live requests delayed;
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

    visionserve bench rollout --out runs/rollout-bench/result.json
    visionserve bench rollout --dry-run     # the candidates and their offline agreement only
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path
from typing import Any

from service.bench import kit
from service.bench.rollout import candidates, scenarios

PARTS = ("latency", "detection", "promotion")


FLAGS: list[kit.Flag] = [
    ("--version-dir", str(candidates.DIGITS_VERSION), "the primary: a served ONNX version folder (the shipped digits)"),
    ("--arch", None, "instead, this models.zoo architecture exported with its initial weights (default: none)"),
    ("--input-size", 64, "--arch's square input"),
    ("--model", "digits", "the model's name in the repositories"),
    ("--parts", ",".join(PARTS), "which runs, comma-separated"),
    ("--dry-run", False, "build and measure the candidates offline, start no server"),
    ("--model-config", "", "serving settings (TOML lines) in every config.toml, before [rollout] (default: none)"),
    ("--workers", 1, "front ends per server", kit.COUNT),
    ("--admin-token", "rollout-bench", "the servers' --admin-token"),
    ("--stream-images", 359, "held-out digits in the stream; past the validation split's 359, training's", kit.COUNT),
    ("--seed", 0, "seeds the label permutation"),
    ("--capacity", None, "requests/s taken as capacity (default: measured)", kit.POSITIVE),
    ("--capacity-clients", 8, "closed-loop clients measuring capacity", kit.COUNT),
    ("--capacity-s", 5.0, "counted seconds of the capacity run", kit.POSITIVE),
    ("--shadow-fraction", 0.1, "shadowed share of requests in a and c", kit.SHARE),
    ("--load", 0.6, "share of capacity in a and c", kit.SHARE),
    ("--high-load", 0.95, "a's second load, where shadows are shed", kit.SHARE),
    ("--rounds", 2, "a's rounds per load, each a window per server", kit.COUNT),
    ("--window-s", 8.0, "seconds of one window in a", kit.POSITIVE),
    ("--warmup-s", 1.0, "a: seconds each server is sent each load before its rounds, not counted", kit.POSITIVE),
    ("--max-ratio", 1.05, "target at --load: p50 and p99 with the shadow / without, each at most this"),
    ("--max-p99-ratio", 1.10, "target: p99 with the shadow / without, at most"),
    ("--min-agreement", 0.99, "the rollouts' min_agreement", kit.SHARE),
    ("--min-samples", 1000, "the rollouts' min_samples before a promotion (the server's own)", kit.COUNT),
    ("--detect-disagreement", 0.02, "the detected candidate's disagreement on the stream, in [0, 1)"),
    ("--promote-disagreement", 0.003, "the promoted candidate's disagreement on the stream, in [0, 1)"),
    ("--detect-rate", 150.0, "requests/s in b", kit.POSITIVE),
    ("--detect-max-samples", 5000, "target: the 2%% candidate detected within this many samples", kit.COUNT),
    ("--detect-samples", 2000, "the detection run goes on past this many samples, to see it stays excluded", kit.COUNT),
    ("--abort-within", 200, "target: the permuted candidate aborted within this many samples"),
    ("--promote-s", 20.0, "seconds of c's open loop", kit.POSITIVE),
    ("--promote-at", 0.5, "share of --promote-s at which c promotes", kit.SHARE),
    ("--poll-s", 0.1, "seconds between polls of the rollout route in b", kit.POSITIVE),
    ("--latency-poll-s", 1.0, "seconds between polls in a and c, both servers alike", kit.POSITIVE),
    ("--timeout-s", 30.0, "per-request timeout"),
    ("--work", "runs/rollout-bench", "candidates, repositories and logs"),
    ("--out", None, "write every figure as JSON here (default: WORK/result.json)"),
]


def usage_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags, or None."""
    parts = [x for x in args.parts.split(",") if x]
    if not parts or any(x not in PARTS for x in parts):
        return f"--parts takes a comma-separated subset of {', '.join(PARTS)}, got {args.parts!r}"
    if not all(0 <= x < 1 for x in (args.detect_disagreement, args.promote_disagreement)):
        return "--detect-disagreement and --promote-disagreement must be in [0, 1)"
    return None


def primary_of(args: argparse.Namespace, work: Path) -> Path:
    if args.arch is None:
        return Path(args.version_dir)
    from service.bench.many_models import export_once

    return export_once(args.arch, args.input_size, 32, work / f"export-{args.arch}-{args.input_size}")


def build_candidates(
    args: argparse.Namespace, primary: Path, digits: candidates.Digits, folder: Path
) -> tuple[dict[str, Path], dict[str, Any]]:
    """The four candidates in ``folder`` and what each disagrees on offline (onnxruntime, the held-out stream)."""
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
        print(
            f"candidate {name:<8} disagrees offline on {offline[name]['disagreement']:7.2%} of "
            f"{len(digits.images)} held-out images",
        )
    return built, offline


def measure_capacity(args: argparse.Namespace, work: Path, primary: Path, pngs: list[bytes]) -> dict[str, Any]:
    if args.capacity is not None:
        return {"requests_per_s": args.capacity, "given": True}
    with scenarios.serve(args, work, "capacity", {1: primary}) as server:
        where = kit.bounds(server.url, 1.0, args.capacity_s, drain_s=5.0, timeout_s=args.timeout_s)
        step = kit.closed_loop(args.model, pngs, args.capacity_clients, where)
    clients = args.capacity_clients
    print(f"capacity: {step.requests_per_s:.0f} requests/s closed loop ({clients} clients), {kit.step_line(step)}")
    return {"clients": args.capacity_clients, "duration_s": args.capacity_s, **kit.step_figures(step)}


def run(args: argparse.Namespace, work: Path, results: dict[str, Any]) -> None:
    primary = primary_of(args, work)
    digits = candidates.held_out_digits(args.stream_images, primary)
    built, offline = build_candidates(args, primary, digits, work / "candidates")
    results.update(
        primary=str(primary), stream={"images": len(digits.images), "held_out": digits.held_out}, offline=offline
    )
    if args.dry_run:
        return
    parts = args.parts.split(",")
    requests = scenarios.requests_for(args.model, digits.pngs)
    results["capacity"] = measure_capacity(args, work, primary, digits.pngs)
    rate = results["capacity"]["requests_per_s"]
    if "latency" in parts:
        print(f"a. live latency, {args.rounds} rounds of {args.window_s:g} s per server and load")
        results["latency"] = scenarios.latency_runs(args, work, primary, built["copy"], requests, rate)
    if "detection" in parts:
        print(f"b. detection at {args.detect_rate:g} req/s, every request shadowed")
        found = scenarios.detection(args, work, primary, built, requests)
        for name in ("detect", "promote"):
            found[name]["offline_disagreement"] = offline[name]["disagreement"]
        results["detection"] = found
    if "promotion" in parts:
        print(f"c. promotion under load: {args.load:.0%} of capacity for {args.promote_s:g} s")
        results["promotion"] = scenarios.promotion(args, work, primary, built["copy"], requests, rate)


def main(args: argparse.Namespace) -> int:
    work = kit.workspace(args, usage_error(args))
    if work is None:
        return 2
    began = time.perf_counter()
    limits = ("max_ratio", "max_p99_ratio", "min_agreement", "detect_max_samples", "abort_within")
    results = kit.header(model=args.model, workers=args.workers, limits={k: getattr(args, k) for k in limits})
    run(args, work, results)
    judged = [results[k]["passed"] for k in PARTS if k in results]
    results["passed"] = all(judged) if judged else None  # none in a dry run
    if not args.dry_run:
        report(results)
    return kit.conclude(results, began, args.out or work / "result.json")


def _n(value: Any, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def report(results: dict[str, Any]) -> None:
    cap, limits = results["capacity"], results["limits"]
    how = "given" if cap.get("given") else f"closed loop, {cap.get('clients')} clients, {cap.get('duration_s')} s"
    lines = [f"\ncapacity: {cap['requests_per_s']:.0f} requests/s ({how})"]
    if "latency" in results:
        a = results["latency"]
        lines.append(
            f"a. live latency with a {a['shadow_fraction']:.0%} shadow against none (interleaved rounds, pooled):"
        )
        for x in a["loads"]:
            s, n, at_high = x["shadow"], x["none"], x["shed_passed"] is not None
            key, what = ("max_p99_ratio", "p99") if at_high else ("max_ratio", "p50 and p99")
            lines.append(
                f"  {kit.VERDICT[x['passed']]} {x['load']:.0%} of capacity ({x['rate']:.0f} req/s): p50 "
                f"{s['p50_ms']:.2f} vs {n['p50_ms']:.2f} ms ({x['p50_ratio']:.3f}x), p99 {s['p99_ms']:.2f} vs "
                f"{n['p99_ms']:.2f} ms ({x['p99_ratio']:.3f}x), target <= {limits[key]:g}x ({what}), errors "
                f"{s['errors']} / {n['errors']}; shadow samples {x['shadow_samples']}, shed {x['shed']}"
                + (" (target > 0)" if at_high else "")
            )
    if "detection" in results:
        d, p, q = (results["detection"][k] for k in ("detect", "promote", "permuted"))
        lines += [
            "b. detection (shadow of every request):",
            f"  {kit.VERDICT[d['passed']]} a candidate disagreeing on {d['offline_disagreement']:.2%} of the held-out "
            f"stream (auto off): agreement_high < {limits['min_agreement']:g} at {_n(d['excluded_at_samples'])} "
            f"samples (poll before: {_n(d['poll_before_samples'])}), and from {_n(d['excluded_for_good_at_samples'])} "
            f"samples on to the run's end at {_n(d['history'][-1]['samples'])} (target <= "
            f"{limits['detect_max_samples']})",
            f"  {kit.VERDICT[p['passed']]} a candidate disagreeing on {p['offline_disagreement']:.2%} (auto on): state "
            f"{p['final'].get('state')}, promoted at {_n(p['promoted_at_samples'])} samples; "
            f"{p['final'].get('verdict_reason', '')}",
            f"  {kit.VERDICT[q['passed']]} a label-permuted candidate (auto on): state {q['final'].get('state')}, "
            f"aborted at {_n(q['aborted_at_samples'])} samples (target <= {limits['abort_within']}); "
            f"{q['final'].get('reason', '')}",
        ]
    if "promotion" in results:
        c = results["promotion"]
        call = c["promote_call"]
        lines += [
            f"c. promotion under load ({c['rate']:.0f} req/s for {c['duration_s']:g} s, promoted at "
            f"{c['promote_at_s']:g} s):",
            f"  {kit.VERDICT[c['passed']]} {c['sent']} sent, {c['recorded']} answered or failed, {c['failed']} failed "
            f"{c['failures'] or ''}, {c['lost']} lost; promote call {call.get('status')} in "
            f"{_n(call.get('took_ms'), 1)} ms; p99 {c['latency']['p99_ms']:.2f} ms overall, "
            f"{c['p99_ms_within_1s_of_promotion']:.2f} ms within 1 s of the promotion; state {c['final_state']}, "
            f"primary {c['final_primary']}, answers after by version {c['versions_after']}",
        ]
    print("\n".join(lines))
