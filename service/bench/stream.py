"""Streams against their targets (docs/streams.md): frames' age bounded under overload, nothing lost, no cost at
light load, and a fast stream held to its share. Real servers (``service.launcher``), the load tester's streams
mode (``loadtest.streams``) and its closed and open loops.

Models (``--models``), served together from one repository built in ``--work``:

- ``paced``: the example digits model with a batch of at most ``--paced-batch`` held ``--paced-delay-ms`` per batch on
  its runtime's thread (``[faults] delay_ms``), so its capacity (``paced-batch / delay``) and compute time are the
  same on any machine;
- ``digits``: the example digits model as shipped (examples/model_repository/digits): the real thing, whose figures
  are this machine's (decoding and the front end cost more than its forward here).

For each model, its capacity: the higher of closed-loop images/s with as many clients as streams (the streams' own
parallelism: each stream has at most one frame computing) and the frames/s answered to as many streams sending
``--probe-load`` x that (a stream pays no HTTP request per frame, so it may be answered more). Then, each printed
with its figures and PASS or MISS:

(a) at ``--overload`` x capacity (streams x fps) for ``--duration`` s: the answered frames' age p99 at most
    ``--age-compute-ratio`` x the batch compute time (the mean of ``visionserve_compute_duration_seconds`` over the
    run, from ``/metrics``; the answers' ``timings_ms.compute`` without metrics); flat: the age p99 of the last
    ``--window`` s at most ``--flat-ratio`` x the first's; every frame accounted for (one answer each, none lost);
(b) at ``--light`` x capacity for ``--other-duration`` s: no frame superseded, expired, failed or lost, and the age
    p50 at most (1 + ``--p50-tolerance``) x the latency p50 of one-shot requests (``/v1/models/M/classify``, the
    load tester's open loop, constant arrivals) at the same rate, measured right after;
(c) fairness, for ``--other-duration`` s: stream 0 at ``--fast-factor`` x the others' rate, the others each at
    ``--fairness-load`` x an even share of capacity: the others' answered rate within ``--fair-tolerance`` of their
    max-min fair share of the frames answered (every stream demanding more than an even share: an even share).

Writes every figure as JSON (``--out``) and each run's streams_over_time.png, results.json and streams.csv under
``--work``/runs. Exit code 0 when every target is met, 1 when one is missed, 2 on a usage error. About 5 minutes
with the defaults on 2 cores::

    visionserve bench stream --out runs/stream-bench/result.json
    visionserve bench stream --quick --out /tmp/sb.json   # under a minute
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest.inputs import payloads
from loadtest.plots import streams_over_time
from loadtest.step import StepSpec
from loadtest.stream_command import measure
from loadtest.stream_report import all_frames, in_window, summarise, write_files
from loadtest.streams import StreamPlan, preflight
from service import launcher
from service.bench import kit
from service.bench.kit import COUNT, POSITIVE, Flag
from service.core.arguments import integer_in, size_pair
from service.core.percentile import percentile
from service.core.samples import image_files, photo_like_jpegs

EXAMPLE = kit.EXAMPLES / "model_repository" / "digits"
SIZES = {
    "duration": (60.0, 6.0, "seconds of target (a)'s run"),
    "other_duration": (15.0, 4.0, "seconds of each run of targets (b) and (c), and of the one-shot run"),
    "window": (15.0, 2.0, "target (a): seconds of its first and last windows"),
    "capacity_s": (5.0, 2.0, "seconds of the closed-loop capacity run"),
    "warmup": (2.0, 0.5, "seconds before each run's measured window (sent, not counted)"),
}
FLAGS: list[Flag] = [
    ("--quick", False, "short runs, a smoke test of under a minute"),
    ("--models", "paced,digits", "which of paced and digits to run, comma-separated"),
    ("--streams", 16, "streams in every run, >= 2 (fairness needs a fast stream and others)", integer_in(2, 10**6)),
    *kit.sized(SIZES),
    ("--drain", 10.0, "seconds after a run for answers still owed"),
    ("--max-age-ms", 500.0, "every stream's max_age_ms", POSITIVE),
    ("--probe-load", 3.0, "capacity: the streams probe's load as a multiple of the closed-loop figure", POSITIVE),
    ("--overload", 2.0, "target (a): load as a multiple of capacity", POSITIVE),
    ("--light", 0.5, "target (b): load as a share of capacity", POSITIVE),
    ("--fast-factor", 10.0, "target (c): the fast stream's rate over the others'", POSITIVE),
    ("--fairness-load", 1.5, "target (c): each other stream's rate, a multiple of an even share", POSITIVE),
    ("--age-compute-ratio", 3.0, "target (a): age p99 at most this x the batch compute time", POSITIVE),
    ("--flat-ratio", 1.5, "target (a): the last window's age p99 at most this x the first's", POSITIVE),
    ("--p50-tolerance", 0.10, "target (b): age p50 at most 1 + this x the one-shot latency p50"),
    ("--fair-tolerance", 0.10, "target (c): the others' answered rate within this share of their fair share"),
    ("--paced-batch", 8, "paced: max_batch_size", COUNT),
    ("--paced-config", "", "paced: more config.toml lines, ';'-separated (default: none)"),
    ("--paced-noop", False, "paced: served by the noop runtime ([faults] noop, a drill): its delay alone sets it"),
    ("--paced-delay-ms", 50.0, "paced: [faults] delay_ms, each batch's fixed compute time", POSITIVE),
    ("--images", None, "folder of images the frames cycle through (default: generated JPEGs of --image-size)"),
    ("--image-size", (500, 375), "generated JPEGs: WIDTHxHEIGHT", size_pair),
    ("--workers", 1, "the server's front ends"),
    ("--work", "runs/stream-bench", "repository, logs and each run's files"),
    ("--out", None, "write every figure as JSON here (default: none)"),
]


def usage_error(args: argparse.Namespace) -> str | None:
    if any(m not in ("paced", "digits") for m in args.models.split(",")):
        return f"--models takes paced and digits, comma-separated; got {args.models!r}"
    if min(args.duration, args.other_duration, args.window, args.capacity_s) <= 0 or min(args.warmup, args.drain) < 0:
        return "durations must be > 0; warm-up and drain >= 0"
    if 2 * args.window > args.duration:
        return f"--window ({args.window:g} s) must fit twice in --duration ({args.duration:g} s)"
    return None


def make_repository(work: Path, args: argparse.Namespace) -> Path:
    """``digits`` as shipped and ``paced``, its copy slow by its config."""
    extra = "".join(f"{line.strip()}\n" for line in args.paced_config.split(";") if line.strip())
    paced = kit.config_toml({"max_batch_size": args.paced_batch}) + extra
    paced += kit.config_toml(faults={"delay_ms": args.paced_delay_ms, **({"noop": True} if args.paced_noop else {})})
    models = {"digits": (EXAMPLE / "config.toml").read_text(), "paced": paced}
    return kit.repository(work / "repository", {name: ({1: EXAMPLE / "1"}, config) for name, config in models.items()})


def capacity(url: str, model: str, images: list[bytes], args: argparse.Namespace) -> dict[str, Any]:
    """The higher of closed-loop images/s with as many clients as streams and the streams probe's answered/s."""
    where = kit.bounds(url, args.warmup, args.capacity_s, drain_s=args.drain)
    step = kit.closed_loop(model, images, args.streams, where)
    server = step.server or {}
    closed = step.images_per_s
    fps = args.probe_load * closed / args.streams
    probe, _ = streams(url, model, "probe", images, args, fps=fps, duration_s=args.capacity_s)
    answered = probe["total"]["answered_per_s"]
    return {
        "images_per_s": max(closed, answered),
        "closed_loop_per_s": closed,
        "probe_answered_per_s": answered,
        "probe_fps": probe["total_fps"],
        "clients": args.streams,
        "errors": step.errors,
        "latency_p50_ms": step.latency_ms(50),
        "compute_ms": server.get("mean_ms", {}).get("compute", math.nan),
        "mean_batch_size": server.get("mean_batch_size", math.nan),
    }


def one_shot(url: str, model: str, rate: float, images: list[bytes], args: argparse.Namespace) -> dict[str, Any]:
    """The load tester's open loop at ``rate`` (constant arrivals): latency from each scheduled send."""
    where = kit.bounds(url, args.warmup, args.other_duration, drain_s=args.drain)
    step = kit.one_step(model, payloads(model, images), StepSpec("open", rate=rate, arrival="constant"), where)
    return {
        "rate": rate,
        "requests": step.requests,
        "errors": step.errors,
        "latency_p50_ms": step.latency_ms(50),
        "latency_p99_ms": step.latency_ms(99),
        "client_limited": step.client_limited,
    }


def streams(
    url: str, model: str, label: str, images: list[bytes], args: argparse.Namespace, **plan: Any
) -> tuple[dict[str, Any], Any]:
    """One streams run of ``plan`` (fps, duration_s, fps_first); its report (and files under WORK/runs/MODEL-LABEL)
    and its frames."""
    at = StreamPlan(
        url, model, args.streams, max_age_ms=args.max_age_ms, warmup_s=args.warmup, drain_s=args.drain, **plan
    )
    run, server = measure(at, images)
    report = summarise(run, server)
    folder = Path(args.work) / "runs" / f"{model}-{label}"
    write_files(report, folder)
    title = f"{model} {label}: {args.streams} streams, {at.total_fps:.4g} frames/s"
    streams_over_time(report, folder / "streams_over_time.png", title)
    return report, run


def client(report: dict[str, Any]) -> dict[str, Any]:
    """The load process's share of a core, its send lag p99 and why it may have set the pace (empty: it did not)."""
    return {
        "cpu": report["client_cpu"],
        "send_lag_p99_ms": report["total"]["send_lag_ms"]["p99"],
        "limited": report["client_limited"],
    }


def _client_note(c: dict[str, Any]) -> str:
    note = f"client {100 * c['cpu']:.0f}% of a core, send lag p99 {c['send_lag_p99_ms']:.1f} ms"
    return note + (f" (LIMITED: {'; '.join(c['limited'])})" if c["limited"] else "")


def fair_shares(demands: Sequence[float], total: float) -> list[float]:
    """Max-min fair split of ``total`` among ``demands`` (water-filling): a stream asking less than an even share
    gets what it asks, the rest share what is left evenly."""
    shares = [0.0] * len(demands)
    left, todo = total, sorted(range(len(demands)), key=lambda k: demands[k])
    while todo:
        even = left / len(todo)
        k = todo.pop(0)
        shares[k] = min(demands[k], even)
        left -= shares[k]
    return shares


def target_overload(url: str, model: str, cap: float, images: list[bytes], args: argparse.Namespace) -> dict[str, Any]:
    fps = args.overload * cap / args.streams
    report, run = streams(url, model, "overload", images, args, fps=fps, duration_s=args.duration)
    compute_ms = (report["server"] or {}).get("mean_ms", {}).get("compute", math.nan)
    source = "/metrics"
    if math.isnan(compute_ms):
        compute_ms, source = report["total"]["compute_ms"]["mean"], "answers' timings_ms.compute"
    frames = all_frames(run)
    start, end = args.warmup, args.warmup + args.duration

    def p99(a: float, b: float) -> float:
        return percentile([f.age_ms for f in in_window(frames, a, b) if f.status == "result"], 0.99)

    first, last = p99(start, start + args.window), p99(end - args.window, end)
    age_p99 = report["total"]["age_ms"]["p99"]
    accounting = report["accounting"]
    return {
        "fps": fps,
        "total_fps": report["total_fps"],
        "duration_s": args.duration,
        "total": report["total"],
        "accounting": accounting,
        "client": client(report),
        "server_frames": (report["server"] or {}).get("stream_frames"),
        "compute_ms": compute_ms,
        "compute_source": source,
        "age": {
            "p99_ms": age_p99,
            "bound_ms": args.age_compute_ratio * compute_ms,
            "passed": age_p99 <= args.age_compute_ratio * compute_ms,
        },
        "flat": {
            "first_p99_ms": first,
            "last_p99_ms": last,
            "ratio": last / first if first else math.nan,
            "passed": last <= args.flat_ratio * first,
        },
        "accounted": {"passed": bool(accounting["ok"])},
    }


def target_light(url: str, model: str, cap: float, images: list[bytes], args: argparse.Namespace) -> dict[str, Any]:
    fps = args.light * cap / args.streams
    report, _ = streams(url, model, "light", images, args, fps=fps, duration_s=args.other_duration)
    single = one_shot(url, model, fps * args.streams, images, args)
    t = report["total"]
    drops = {"superseded": t["superseded"], "expired": t["expired"], "errors": t["errors"], "lost": t["lost"]}
    ratio = t["age_ms"]["p50"] / single["latency_p50_ms"]
    return {
        "fps": fps,
        "total_fps": report["total_fps"],
        "duration_s": args.other_duration,
        "total": t,
        "accounting": report["accounting"],
        "one_shot": single,
        "client": client(report),
        "drops": drops | {"passed": not any(drops.values()) and report["accounting"]["ok"]},
        "p50": {
            "age_p50_ms": t["age_ms"]["p50"],
            "stream_latency_p50_ms": t["latency_ms"]["p50"],
            "one_shot_p50_ms": single["latency_p50_ms"],
            "ratio": ratio,
            "passed": ratio <= 1 + args.p50_tolerance,
        },
    }


def target_fairness(url: str, model: str, cap: float, images: list[bytes], args: argparse.Namespace) -> dict[str, Any]:
    fps = args.fairness_load * cap / args.streams
    fast = args.fast_factor * fps
    report, _ = streams(url, model, "fairness", images, args, fps=fps, duration_s=args.other_duration, fps_first=fast)
    rows = report["per_stream"]
    shares = fair_shares([r["sent_per_s"] for r in rows], report["total"]["answered_per_s"])
    others = rows[1:]
    got = sum(r["answered_per_s"] for r in others) / len(others)
    share = sum(shares[1:]) / len(others)
    worst = max(others, key=lambda r: abs(r["answered_per_s"] / (shares[r["stream"]] or math.nan) - 1))
    deviation = got / share - 1 if share else math.nan
    return {
        "fps": fps,
        "fast_fps": fast,
        "duration_s": args.other_duration,
        "accounting": report["accounting"],
        "client": client(report),
        "fast": {
            "answered_per_s": rows[0]["answered_per_s"],
            "fair_share_per_s": shares[0],
            "answered_fraction": rows[0]["answered_fraction"],
            "superseded": rows[0]["superseded"],
        },
        "others": {
            "answered_per_s": got,
            "fair_share_per_s": share,
            "deviation": deviation,
            "answered_fraction": sum(r["answered_fraction"] for r in others) / len(others),
            "fair_fraction": share / fps,
            "worst_stream": worst["stream"],
            "worst_deviation": worst["answered_per_s"] / (shares[worst["stream"]] or math.nan) - 1,
        },
        "passed": abs(deviation) <= args.fair_tolerance,
    }


def print_model(name: str, r: dict[str, Any], args: argparse.Namespace) -> None:
    cap, a, b, c = r["capacity"], r["overload"], r["light"], r["fairness"]
    acc, age, flat, drops, p50, others = a["accounting"], a["age"], a["flat"], b["drops"], b["p50"], c["others"]
    lines = [
        f"{name}: capacity {cap['images_per_s']:.1f} images/s: closed loop {cap['closed_loop_per_s']:.1f}/s with "
        f"{cap['clients']} clients (mean batch {cap['mean_batch_size']:.1f}, compute {cap['compute_ms']:.1f} ms a "
        f"batch), streams answered {cap['probe_answered_per_s']:.1f}/s of {cap['probe_fps']:.0f} fps sent",
        f"  (a) {args.overload:g}x capacity: {args.streams} streams x {a['fps']:.1f} fps = {a['total_fps']:.0f} fps "
        f"for {a['duration_s']:g} s: answered {a['total']['answered_per_s']:.1f}/s "
        f"({100 * a['total']['answered_fraction']:.0f}%); {_client_note(a['client'])}",
        f"      age p99 {age['p99_ms']:.1f} ms <= {args.age_compute_ratio:g} x compute {a['compute_ms']:.1f} ms "
        f"({a['compute_source']}) = {age['bound_ms']:.1f} ms: {kit.VERDICT[age['passed']]}",
        f"      flat: age p99 first {args.window:g} s {flat['first_p99_ms']:.1f} ms, last {flat['last_p99_ms']:.1f} "
        f"ms (x{flat['ratio']:.2f} <= {args.flat_ratio:g}): {kit.VERDICT[flat['passed']]}",
        f"      accounted: {acc['sent']} sent = {acc['answered']} answered + {acc['superseded']} superseded + "
        f"{acc['expired']} expired + {acc['errors']} errors; {acc['lost']} lost, {acc['unexpected']} unexpected: "
        f"{kit.VERDICT[a['accounted']['passed']]}",
        f"  (b) {100 * args.light:g}% of capacity: {args.streams} streams x {b['fps']:.2f} fps = "
        f"{b['total_fps']:.1f} fps for {b['duration_s']:g} s; one-shot open loop at the same rate; "
        f"{_client_note(b['client'])}",
        f"      drops: {drops['superseded']} superseded, {drops['expired']} expired, {drops['errors']} errors, "
        f"{drops['lost']} lost: {kit.VERDICT[drops['passed']]}",
        f"      age p50 {p50['age_p50_ms']:.1f} ms vs one-shot latency p50 {p50['one_shot_p50_ms']:.1f} ms "
        f"(x{p50['ratio']:.2f} <= {1 + args.p50_tolerance:g}): {kit.VERDICT[p50['passed']]} [the streams' client "
        f"latency p50: {p50['stream_latency_p50_ms']:.1f} ms]",
        f"  (c) fairness: stream 0 at {c['fast_fps']:.0f} fps, {args.streams - 1} at {c['fps']:.1f} fps for "
        f"{c['duration_s']:g} s: the others answered {others['answered_per_s']:.2f}/s each (fraction "
        f"{100 * others['answered_fraction']:.0f}%) vs a fair share {others['fair_share_per_s']:.2f}/s "
        f"({100 * others['fair_fraction']:.0f}%): {100 * others['deviation']:+.1f}% (within "
        f"{100 * args.fair_tolerance:g}%): {kit.VERDICT[c['passed']]}",
        f"      worst other stream {others['worst_stream']}: {100 * others['worst_deviation']:+.1f}%; the fast stream "
        f"{c['fast']['answered_per_s']:.2f}/s (fair {c['fast']['fair_share_per_s']:.2f}/s), "
        f"{c['fast']['superseded']} superseded; {_client_note(c['client'])}",
    ]
    print("\n".join(lines))


def main(args: argparse.Namespace) -> int:
    work = kit.workspace(args, usage_error(kit.settle(args, SIZES)))
    if work is None:
        return 2
    began = time.perf_counter()
    images = image_files(args.images) if args.images else photo_like_jpegs(32, args.image_size)
    repo = make_repository(work, args)
    limits = "overload light fast_factor fairness_load age_compute_ratio flat_ratio p50_tolerance fair_tolerance window"
    results = kit.header(streams=args.streams, max_age_ms=args.max_age_ms, image_size=list(args.image_size))
    results["paced"] = {"max_batch_size": args.paced_batch, "delay_ms": args.paced_delay_ms}
    results |= {"limits": {k: getattr(args, k) for k in limits.split()}, "models": {}}
    with launcher.start(repo, "--workers", str(args.workers), log=work / "server.log", ready_timeout_s=300) as server:
        for model in args.models.split(","):
            problem = preflight(StreamPlan(url=server.url, model=model, streams=1, fps=1.0), images[0])
            if problem:
                print(f"{model}: {problem}", file=sys.stderr)
                return 2
            r: dict[str, Any] = {"capacity": capacity(server.url, model, images, args)}
            cap = r["capacity"]["images_per_s"]
            r["overload"] = a = target_overload(server.url, model, cap, images, args)
            r["light"] = b = target_light(server.url, model, cap, images, args)
            r["fairness"] = target_fairness(server.url, model, cap, images, args)
            judged = (a["age"], a["flat"], a["accounted"], b["drops"], b["p50"], r["fairness"])
            r["passed"] = all(x["passed"] for x in judged)
            results["models"][model] = r
            print_model(model, r, args)
    results["passed"] = all(r["passed"] for r in results["models"].values())
    return kit.conclude(results, began, args.out)
