"""Many models on one device, against the issue's targets: N on-demand models of one architecture under zipf traffic,
a memory budget that holds K of them, and what that costs.

The models: one architecture exported once (``--arch``, ``--input-size``), copied ``--models`` times into
``--work``, each copy with its own weights (its final layer's bias moved by a seeded amount of its own, with the
``onnx`` package) and its own labels (``m07/tench``), so every answer says which model gave it. The budget is
``(--capacity + 0.5)`` x one model's charged size, measured first on a probe server
(``visionserve_model_resident_bytes`` of a copy loaded by a request after a pinned copy, whose charge also holds
onnxruntime's start): what the engine really measured, never a configured size.

Targets, each printed PASS or MISS with its figures:

1. correct answers: every answer's label comes from the model asked (its prefix), no 5xx, no server death;
2. hit rate (answers without ``cold_start`` in ``Server-Timing``) within ``--hit-rate-points`` of an ideal LRU cache
   of ``--capacity`` models replayed offline on the same request sequence;
3. p99 of hits within ``--p99-ratio`` of a server with the ``--capacity`` most popular models pinned, sent the same
   sequence's requests for those models at the same moments (it never loads: the price hits pay for serving the
   other models beside them, loads and their answers included), in ``--rounds`` interleaved rounds;
4. the cold start of ``--cold-arch`` (resnet18, initial weights) in parts: read, session build, warm-up, with the
   project's runtime in this process and served (the first request's ``cold_start``); Triton's explicit load of the
   same file with ``--triton`` where the peers kit (../shared/peers) is set up;
5. memory: every ``--scrape-s``, the charged bytes never above the budget plus one model's size, and the engine's
   RSS growth over its RSS before any load within ``--rss-tolerance`` of the charged sum. The charged bytes are read
   from ``GET /v1/models`` by default: ``/metrics`` of 40 models is 4 MB rendered on the engine's event loop in 0.3-1.2
   s, and read every 0.5 s it stalls the hits being measured (``--scrape-from metrics`` to see it; docs/performance.md,
   "Many models on one device"); both are read at the end and printed side by side.

The traffic is an open loop (seeded Poisson arrivals at ``--rate``, seeded zipf draw of the load tester's
``loadtest.mix``, written to ``--write-sequence``), sent from here with httpx by a bounded thread pool, since the
answers' labels must be read (the load tester keeps only histograms). Latency counts from each request's scheduled
moment. The default rate keeps the on-demand server at about a third of two cores, hits off any queue (their p50
equals the pinned server's; docs/performance.md says how it was chosen). Exit code 0 when every target is met, 1
when one is missed, 2 on a usage error::

    visionserve bench many-models --out runs/many-models/result.json
    visionserve bench many-models --quick --out /tmp/mm.json   # 20 s: a few small models
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from loadtest.mix import ModelDraw, cold_start_ms, draw_seed, make_mix
from service import launcher
from service.bench import kit
from service.bench.coldstart import cold_in_process, cold_served, triton_load
from service.bench.many_models_report import Answer, judge, report

SOURCES = ("models", "metrics")
READ_ERRORS = (httpx.HTTPError, ValueError)
BUILD_STAMP = "build.json"


SIZES = {
    "models": (40, 6, "on-demand models"),
    "capacity": (8, 2, "models the budget holds: (capacity + 0.5) x one model's measured size"),
    "arch": ("resnet18", "smallcnn", "the models' architecture (models.zoo)"),
    "input_size": (64, 32, "the models' square input"),
    "rate": (6.0, 12.0, "requests/s, open loop"),
    "duration_s": (75.0, 4.0, "seconds of traffic per round"),
    "rounds": (2, 1, "interleaved rounds of the on-demand server and the pinned one"),
    "cold_arch": ("resnet18", "smallcnn", "the model whose cold start is taken apart"),
    "cold_input_size": (224, 32, "its square input"),
}
FLAGS: list[kit.Flag] = [
    ("--quick", False, "small sizes for a smoke run of under a minute"),
    *kit.sized(SIZES),
    ("--max-batch-size", 4, "every model's max_batch_size"),
    ("--cold-max-batch-size", 8, "the cold-start model's max_batch_size; warm-up runs each bucket up to it"),
    ("--cold-repeats", 3, "in-process cold starts, the first apart", kit.COUNT),
    ("--popularity", "zipf:1.1", "uniform or zipf:S, ranked m00 first"),
    ("--seed", 0, "seeds the draw, the arrivals and the weights"),
    ("--clients", 32, "threads sending requests", kit.COUNT),
    ("--timeout-s", 60.0, "per-request timeout"),
    ("--scrape-s", 0.5, "seconds between reads of the charged bytes and the engine's RSS", kit.POSITIVE),
    (
        "--scrape-from",
        "models",
        "where the charged bytes are read: GET /v1/models (the front end's catalog) or "
        "/metrics, rendered on the engine's event loop (about 300 ms for 40 models: it stalls the hits)",
        SOURCES,
    ),
    ("--min-residency-s", 1.0, "serve's --min-residency-s (default: 1.0, serve's own)"),
    ("--max-parallel-loads", 2, "serve's --max-parallel-loads (default: 2, serve's own)"),
    ("--hit-rate-points", 5.0, "target: hit rate within this many points of the ideal LRU's"),
    ("--p99-ratio", 1.10, "target: p99 of hits at most this x the pinned server's"),
    ("--rss-tolerance", 0.15, "target: RSS growth / charged bytes within 1 +- this"),
    ("--triton", False, "also time Triton's explicit load of the cold-start model (needs ../shared/peers set up)"),
    ("--peers-home", os.path.expanduser("~/.cache/visionserve-peers"), "the peers kit's state, with .venv-triton"),
    ("--work", "runs/many-models", "models, sequence and logs; the models are kept and reused"),
    ("--write-sequence", None, "every request's model in send order (default: WORK/sequence.txt)"),
    ("--out", None, "write every figure as JSON here (default: none)"),
]


def export_once(arch: str, input_size: int, max_batch_size: int, folder: Path) -> Path:
    """``arch`` with its initial weights exported to ONNX in ``folder`` (kept: a second call reuses it)."""
    version = folder / "source" / "1"
    if (version / "model.onnx").is_file() and (version / "spec.json").is_file():
        return version
    from export.exporter import ExportRequest, export_model
    from export.sources import from_architecture

    shutil.rmtree(folder, ignore_errors=True)
    source = from_architecture(arch, input_size=input_size)
    request = ExportRequest(
        name="source",
        repository=str(folder),
        version=1,
        formats=("onnx",),
        latency=False,
        max_batch_size=max_batch_size,
    )
    export_model(source.eager, source.spec, request)
    return version


def on_demand_config(max_batch_size: int, pinned: bool = False) -> str:
    residency = "pinned" if pinned else "on_demand"
    return kit.config_toml({"residency": residency, "max_batch_size": max_batch_size, "max_queue_delay_ms": 2.0})


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
    stamp = {k: getattr(args, k) for k in ("arch", "input_size", "models", "seed", "max_batch_size")}
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
    print(
        f"built {len(names)} {args.arch} models ({args.input_size}x{args.input_size}) in {repo} in "
        f"{time.perf_counter() - started:.1f} s",
    )
    return names, repo


def residency(url: str) -> dict[str, Any]:
    """The residency gauges of ``/metrics``: charged bytes per model, and on the CPU in all."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, Any] = {"models": {}, "device_bytes": 0.0}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            if s.name == "visionserve_model_resident_bytes" and s.value > 0:
                out["models"][s.labels["model"]] = s.value
            elif s.name == "visionserve_device_resident_bytes" and s.labels.get("device") == "cpu":
                out["device_bytes"] = s.value
    return out


def rss_bytes(pid: int) -> int:
    """Resident bytes of one process (``/proc/PID/statm``, as the engine measures itself); 0 once it is gone."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def listed(url: str) -> dict[str, float]:
    """The charged bytes of each resident model as ``GET /v1/models`` lists them (the front end's catalog)."""
    rows = httpx.get(url + "/v1/models", timeout=10).json()
    return {r["name"]: float(r["resident_bytes"]) for r in rows if r.get("resident")}


def scrape(server: launcher.RunningServer, pid: int, source: str, engines: set[int]) -> dict[str, Any]:
    """The charged bytes and the engine's RSS, read from ``/v1/models`` (``source="models"``) or ``/metrics``, with
    how long the read took; every engine process seen is added to ``engines``."""
    engines.update(server.roles()["engine"])
    began = time.perf_counter()
    if source == "metrics":
        seen = residency(server.url)
        charged, resident = seen["device_bytes"], len(seen["models"])
    else:
        models = listed(server.url)
        charged, resident = sum(models.values()), len(models)
    took_ms = 1000 * (time.perf_counter() - began)
    return {"charged": charged, "resident": resident, "rss": rss_bytes(pid), "read_ms": took_ms}


def make_sequence(names: Sequence[str], args: argparse.Namespace) -> list[tuple[float, str]]:
    """(due second, model) for ``--duration-s`` of Poisson arrivals at ``--rate``; models drawn as the load tester
    draws them (``loadtest.mix``: the same seed gives the same models)."""
    draw = ModelDraw(make_mix(names, args.popularity).cumulative, draw_seed(args.seed, 0))
    arrivals = random.Random(args.seed)
    out: list[tuple[float, str]] = []
    t = 0.0
    while True:
        t += arrivals.expovariate(args.rate)
        if t >= args.duration_s:
            return out
        out.append((t, names[draw.next()]))


def drive(url: str, sequence: Sequence[tuple[float, str]], body: bytes, args: argparse.Namespace) -> list[Answer]:
    """Send each request at its moment from a pool of ``--clients`` threads; every answer's label and cold start."""
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    headers = {"Content-Type": "image/jpeg"}
    with httpx.Client(base_url=url, timeout=args.timeout_s, limits=limits) as client:

        def one(start: float, due: float, model: str) -> Answer:
            label, timing = None, ""
            try:
                r = client.post(f"/v1/models/{model}/classify?top_k=1", content=body, headers=headers)
                timing = r.headers.get("server-timing", "")
                outcome, cold = str(r.status_code), cold_start_ms(timing)
                if r.status_code == 200:
                    label = r.json()["results"][0]["predictions"][0]["label"]
            except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
                outcome, cold = type(exc).__name__, None
            return Answer(model, due, time.perf_counter() - start - due, outcome, label, cold, timing)

        with ThreadPoolExecutor(args.clients, thread_name_prefix="client") as pool:
            start = time.perf_counter()
            futures = []
            for due, model in sequence:
                delay = start + due - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                futures.append(pool.submit(one, start, due, model))
            return [f.result() for f in futures]


def start(repo: Path, log: Path, *flags: str) -> launcher.RunningServer:
    return launcher.start(repo, "--workers", "1", *flags, log=log, ready_timeout_s=300)


def run_server(
    repo: Path, sequence: list[tuple[float, str]], body: bytes, args: argparse.Namespace, log: Path, *flags: str
) -> dict[str, Any]:
    """A fresh server (on demand with a budget's ``flags``, or pinned): its engine's RSS before any load, then the
    traffic, the charged bytes and RSS read alike on both (one side's reads must not cost it alone)."""
    server = start(repo, log, *flags)
    try:
        engines = server.roles()["engine"]
        if len(engines) != 1:
            raise RuntimeError(f"expected one engine process under {server.process.pid}, found {engines}")
        pid = engines[0]
        rss_empty, seen = rss_bytes(pid), {pid}
        scraper = kit.Sampler(lambda: scrape(server, pid, args.scrape_from, seen), args.scrape_s, READ_ERRORS, False)
        scraper.start()
        cpu = kit.CpuClock(server.process.pid)
        answers = drive(server.url, sequence, body, args)
        cpu_share = cpu.cores()
        samples = [sample for _, sample in scraper.finish(last=False)]
        time.sleep(1.0)  # the catalog follows the engine within a beat
        began = time.perf_counter()
        metrics_bytes = residency(server.url)["device_bytes"]  # the two sources agree at the end
        end = {"metrics_bytes": metrics_bytes, "metrics_read_ms": 1000 * (time.perf_counter() - began)}
        end["listed_bytes"] = sum(listed(server.url).values())
        alive = server.process.poll() is None and seen == {pid}
    finally:
        code = launcher.stop(server)
    figures = {"answers": answers, "samples": samples, "rss_empty": rss_empty, "alive": alive, "exit_code": code}
    return figures | {"engines_seen": sorted(seen), "server_cores": cpu_share, "end": end}


def usage_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags, or None."""
    if min(args.models, args.capacity, args.rounds) < 1 or args.capacity >= args.models:
        return "--models, --capacity and --rounds must be >= 1, --capacity < --models"
    if min(args.rate, args.duration_s) <= 0:
        return "--rate and --duration-s must be > 0"
    try:
        make_mix(["a"], args.popularity)
    except ValueError as exc:
        return str(exc)
    return None


def probe(
    args: argparse.Namespace, work: Path, repo: Path, names: Sequence[str], cold_version: Path, body: bytes
) -> tuple[int, int, dict[str, Any]]:
    """One model's charged size and the served cold start of the cold-start model, on one server. A copy pinned
    loads first, and its charge includes starting onnxruntime in the engine; a second copy, loaded by a request
    after it, is charged what each of the on-demand models is: that size makes the budget. Returns the first
    copy's charge, that size and the served cold start."""
    copy, batch = {1: repo / names[0] / "1"}, args.max_batch_size
    models = {"first": (copy, on_demand_config(batch, pinned=True)), "size": (copy, on_demand_config(batch))}
    models["cold"] = ({1: cold_version}, on_demand_config(args.cold_max_batch_size))
    with start(kit.repository(work / "probe", models), work / "logs" / "probe.log") as server:
        cold_served(server, "size", body)
        charged = residency(server.url)["models"]
        first, size = int(charged["first"]), int(charged["size"])
        return first, size, cold_served(server, "cold", body)


def run_rounds(args: argparse.Namespace, sides: dict[str, Any], body: bytes, logs: Path) -> list[dict[str, Any]]:
    """``--rounds`` rounds of the on-demand server (A) and the pinned one (B), interleaved AB, BA, ...; ``sides``:
    each one's (repository, arrivals, name, serve flags)."""
    rounds = []
    for k in range(args.rounds):
        order = "AB" if k % 2 == 0 else "BA"
        done: dict[str, Any] = {"order": order}
        for side in order:
            repo, sequence, name, flags = sides[side]
            done[side.lower()] = figures = run_server(repo, sequence, body, args, logs / f"{name}-{k}.log", *flags)
            ok = [a.latency_s for a in figures["answers"] if a.outcome == "200"]
            print(
                f"round {k + 1} {name}: {len(ok)}/{len(figures['answers'])} ok, p50 {kit.ms(ok, 0.5):.1f} ms, p99 "
                f"{kit.ms(ok, 0.99):.1f} ms, server CPU {figures['server_cores']:.2f} cores",
            )
        rounds.append(done)
    return rounds


def cold_start(args: argparse.Namespace, cold_version: Path, served: dict[str, Any], work: Path) -> dict[str, Any]:
    """The cold start of ``--cold-arch`` in parts: in process, served (measured by the probe) and Triton's."""
    in_process = cold_in_process(cold_version, args.cold_max_batch_size, args.cold_repeats)
    cold = {k: getattr(args, f"cold_{k}") for k in ("arch", "input_size", "max_batch_size")}
    triton = triton_load(args, cold_version, work)
    return cold | {"in_process": in_process, "served": served, "triton": triton, "file_bytes": in_process["file_bytes"]}


def main(args: argparse.Namespace) -> int:
    work = kit.workspace(args, usage_error(kit.settle(args, SIZES)))
    if work is None:
        return 2
    from service.core.samples import photo_like_jpegs

    began, logs = time.perf_counter(), work / "logs"
    body = photo_like_jpegs(1, (64, 64), seed=args.seed)[0]
    names, repo = build_models(args, work)
    cold_folder = work / f"export-{args.cold_arch}-{args.cold_input_size}"
    cold_version = export_once(args.cold_arch, args.cold_input_size, args.cold_max_batch_size, cold_folder)

    first, size, served = probe(args, work, repo, names, cold_version, body)
    budget = int((args.capacity + 0.5) * size)
    print(
        f"one model charged {size / 1e6:.1f} MB (the first load, with onnxruntime's start: {first / 1e6:.1f} MB): "
        f"budget {budget / 1e6:.1f} MB",
    )
    cold = cold_start(args, cold_version, served, work)

    sequence = make_sequence(names, args)
    sequence_file = Path(args.write_sequence or work / "sequence.txt")
    sequence_file.write_text("".join(m + "\n" for _, m in sequence))
    top = names[: args.capacity]
    pinned_config = on_demand_config(args.max_batch_size, pinned=True)
    pinned = kit.repository(work / "pinned", {n: ({1: repo / n / "1"}, pinned_config) for n in top})
    top_sequence = [(t, m) for t, m in sequence if m in top]
    print(
        f"{len(sequence)} requests over {len(names)} models ({len(top_sequence)} to the top {len(top)}); "
        f"sequence in {sequence_file}",
    )
    flags = ["--memory-budget", f"cpu={budget}", "--min-residency-s", str(args.min_residency_s)]
    flags += ["--max-parallel-loads", str(args.max_parallel_loads)]
    sides = {"A": (repo, sequence, "on-demand", flags), "B": (pinned, top_sequence, "pinned", [])}
    rounds = run_rounds(args, sides, body, logs)

    sizes = {k: getattr(args, k) for k in ("models", "capacity", "rate", "duration_s", "scrape_s", "rounds")}
    results = kit.header(**sizes, arch=f"{args.arch} {args.input_size}x{args.input_size}", popularity=args.popularity)
    results |= {"requests": len(sequence), "model_bytes": size, "first_model_bytes": first, "budget_bytes": budget}
    results["sequence_file"] = str(sequence_file)
    results["limits"] = {k: getattr(args, k) for k in ("hit_rate_points", "p99_ratio", "rss_tolerance")}
    results |= judge(args, size, budget, sequence, rounds) | {"cold_start": cold}
    verdicts = [results[k]["passed"] for k in ("correct", "hit_rate", "p99_hits")]
    results["passed"] = all((*verdicts, results["memory"]["charged_passed"], results["memory"]["rss_passed"]))
    report(results)
    return kit.conclude(results, began, args.out)
