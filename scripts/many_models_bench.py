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

    .venv/bin/python scripts/many_models_bench.py --out runs/many-models/result.json
    .venv/bin/python scripts/many_models_bench.py --quick --out /tmp/mm.json   # 20 s: a few small models
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from manymodels.coldstart import cold_in_process, cold_served, triton_load
from manymodels.judge import judge, ms
from manymodels.memory import Scraper, engine_pid, listed, residency, rss_bytes
from manymodels.models import build_models, export_once, on_demand_config, repository_of
from manymodels.report import json_safe, report
from manymodels.traffic import drive, make_sequence

from loadtest.mix import make_mix
from service import launcher

FULL = {"models": 40, "capacity": 8, "arch": "resnet18", "input_size": 64, "rate": 6.0, "duration_s": 75.0,
        "rounds": 2, "cold_arch": "resnet18", "cold_input_size": 224}  # fmt: skip
QUICK = {"models": 6, "capacity": 2, "arch": "smallcnn", "input_size": 32, "rate": 12.0, "duration_s": 4.0,
         "rounds": 1, "cold_arch": "smallcnn", "cold_input_size": 32}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)

    def sized(flag: str, kind: type, what: str) -> None:
        key = flag.lstrip("-").replace("-", "_")
        p.add_argument(flag, type=kind, default=None, help=f"{what} (default: {FULL[key]}; {QUICK[key]} with --quick)")

    p.add_argument("--quick", action="store_true", help="small sizes for a smoke run of under a minute (default: off)")
    sized("--models", int, "on-demand models")
    sized("--capacity", int, "models the budget holds: (capacity + 0.5) x one model's measured size")
    sized("--arch", str, "the models' architecture (models.zoo)")
    sized("--input-size", int, "the models' square input")
    sized("--rate", float, "requests/s, open loop")
    sized("--duration-s", float, "seconds of traffic per round")
    sized("--rounds", int, "interleaved rounds of the on-demand server and the pinned one")
    sized("--cold-arch", str, "the model whose cold start is taken apart")
    sized("--cold-input-size", int, "its square input")
    p.add_argument("--max-batch-size", type=int, default=4, help="every model's max_batch_size (default: "
                   "%(default)s)")  # fmt: skip
    p.add_argument("--cold-max-batch-size", type=int, default=8, help="the cold-start model's max_batch_size; "
                   "warm-up runs each bucket up to it (default: %(default)s)")  # fmt: skip
    p.add_argument("--cold-repeats", type=int, default=3, help="in-process cold starts, the first apart "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--popularity", default="zipf:1.1", help="uniform or zipf:S, ranked m00 first "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seeds the draw, the arrivals and the weights "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--clients", type=int, default=32, help="threads sending requests (default: %(default)s)")
    p.add_argument("--timeout-s", type=float, default=60.0, help="per-request timeout (default: %(default)s)")
    p.add_argument("--scrape-s", type=float, default=0.5, help="seconds between reads of the charged bytes and the "
                   "engine's RSS (default: %(default)s)")  # fmt: skip
    p.add_argument("--scrape-from", choices=("models", "metrics"), default="models", help="where the charged bytes "
                   "are read: GET /v1/models (the front end's catalog) or /metrics, which the engine renders on its "
                   "event loop (about 300 ms for 40 models here: every 0.5 s it stalls the hits it measures) "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--min-residency-s", type=float, default=1.0, help="serve's --min-residency-s "
                   "(default: %(default)s, serve's own)")  # fmt: skip
    p.add_argument("--max-parallel-loads", type=int, default=2, help="serve's --max-parallel-loads "
                   "(default: %(default)s, serve's own)")  # fmt: skip
    p.add_argument("--hit-rate-points", type=float, default=5.0, help="target: hit rate within this many points "
                   "of the ideal LRU's (default: %(default)s)")  # fmt: skip
    p.add_argument("--p99-ratio", type=float, default=1.10, help="target: p99 of hits at most this x the pinned "
                   "server's (default: %(default)s)")  # fmt: skip
    p.add_argument("--rss-tolerance", type=float, default=0.15, help="target: RSS growth / charged bytes within "
                   "1 +- this (default: %(default)s)")  # fmt: skip
    p.add_argument("--triton", action="store_true", help="also time Triton's explicit load of the cold-start model "
                   "(needs ../shared/peers set up) (default: off)")  # fmt: skip
    p.add_argument("--peers-home", default=os.path.expanduser("~/.cache/visionserve-peers"), help="the peers kit's "
                   "state, with .venv-triton (default: %(default)s)")  # fmt: skip
    p.add_argument("--work", default="runs/many-models", help="models, sequence and logs; the models are kept "
                   "and reused (default: %(default)s)")  # fmt: skip
    p.add_argument("--write-sequence", default=None, help="every request's model in send order (default: "
                   "WORK/sequence.txt)")  # fmt: skip
    p.add_argument("--out", default=None, help="write every figure as JSON here (default: none)")
    return p


def settle(args: argparse.Namespace) -> argparse.Namespace:
    """The sized flags not given take the full or the quick default."""
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


# ---- the runs -----------------------------------------------------------------------------------------------------
def start(repo: Path, log: Path, *flags: str) -> launcher.RunningServer:
    return launcher.start(repo, "--workers", "1", *flags, log=log, ready_timeout_s=300)


def run_on_demand(repo: Path, sequence: list[tuple[float, str]], body: bytes, budget: int, args: argparse.Namespace,
                  log: Path) -> dict[str, Any]:  # fmt: skip
    """The on-demand server, fresh: its engine's RSS before any load, then the traffic with scrapes."""
    server = start(repo, log, "--memory-budget", f"cpu={budget}", "--min-residency-s", str(args.min_residency_s),
                   "--max-parallel-loads", str(args.max_parallel_loads))  # fmt: skip
    try:
        pid = engine_pid(server)
        rss_empty = rss_bytes(pid)
        scraper = Scraper(server, pid, args.scrape_s, args.scrape_from)
        scraper.start()
        cpu_s, began = launcher.tree_cpu_s(server.process.pid), time.perf_counter()
        answers = drive(server.url, sequence, body, args)
        cpu_share = (launcher.tree_cpu_s(server.process.pid) - cpu_s) / (time.perf_counter() - began)
        samples = scraper.finish()
        time.sleep(1.0)  # the catalog follows the engine within a beat
        began = time.perf_counter()
        metrics = residency(server.url)  # the two sources agree at the end
        end = {"metrics_bytes": metrics["device_bytes"], "metrics_read_ms": 1000 * (time.perf_counter() - began),
               "listed_bytes": sum(listed(server.url).values())}  # fmt: skip
        alive = server.process.poll() is None and scraper.engines_seen == {pid}
    finally:
        code = launcher.stop(server)
    return {"answers": answers, "samples": samples, "rss_empty": rss_empty, "alive": alive, "exit_code": code,
            "engines_seen": sorted(scraper.engines_seen), "server_cores": cpu_share, "end": end}  # fmt: skip


def run_pinned(repo: Path, sequence: list[tuple[float, str]], body: bytes, args: argparse.Namespace,
               log: Path) -> dict[str, Any]:  # fmt: skip
    server = start(repo, log)
    try:
        scraper = Scraper(server, engine_pid(server), args.scrape_s, args.scrape_from)  # read alike, as A is
        scraper.start()
        cpu_s, began = launcher.tree_cpu_s(server.process.pid), time.perf_counter()
        answers = drive(server.url, sequence, body, args)
        cpu_share = (launcher.tree_cpu_s(server.process.pid) - cpu_s) / (time.perf_counter() - began)
        scraper.finish()
        alive = server.process.poll() is None
    finally:
        code = launcher.stop(server)
    return {"answers": answers, "alive": alive, "exit_code": code, "server_cores": cpu_share}


def usage_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags, or None."""
    counts = (args.models, args.capacity, args.rounds, args.clients, args.cold_repeats)
    if min(counts) < 1 or args.capacity >= args.models:
        return "--models, --capacity, --rounds, --clients and --cold-repeats must be >= 1, --capacity < --models"
    if min(args.rate, args.duration_s, args.scrape_s) <= 0:
        return "--rate, --duration-s and --scrape-s must be > 0"
    try:
        make_mix(["a"], args.popularity)
    except ValueError as exc:
        return str(exc)
    return None


def probe(args: argparse.Namespace, work: Path, repo: Path, names: Sequence[str], cold_version: Path,
          body: bytes) -> tuple[int, int, dict[str, Any]]:  # fmt: skip
    """One model's charged size and the served cold start of the cold-start model, on one server. A copy pinned
    loads first, and its charge includes starting onnxruntime in the engine; a second copy, loaded by a request
    after it, is charged what each of the on-demand models is: that size makes the budget. Returns the first
    copy's charge, that size and the served cold start."""
    folder = repository_of(work / "probe", {
        "first": (repo / names[0], on_demand_config(args.max_batch_size, pinned=True)),
        "size": (repo / names[0], on_demand_config(args.max_batch_size)),
        "cold": (cold_version.parent, on_demand_config(args.cold_max_batch_size)),
    })  # fmt: skip
    with start(folder, work / "logs" / "probe.log") as server:
        cold_served(server, "size", body)
        charged = residency(server.url)["models"]
        first, size = int(charged["first"]), int(charged["size"])
        served = cold_served(server, "cold", body)
    return first, size, served


def run_rounds(args: argparse.Namespace, repo: Path, pinned: Path, sequence: list[tuple[float, str]],
               top_sequence: list[tuple[float, str]], body: bytes, budget: int,
               logs: Path) -> list[dict[str, Any]]:  # fmt: skip
    """``--rounds`` rounds of the on-demand server (A) and the pinned one (B), interleaved AB, BA, ..."""
    rounds = []
    for k in range(args.rounds):
        order = "AB" if k % 2 == 0 else "BA"
        done: dict[str, Any] = {"order": order}
        for side in order:
            if side == "A":
                done["a"] = run_on_demand(repo, sequence, body, budget, args, logs / f"on-demand-{k}.log")
            else:
                done["b"] = run_pinned(pinned, top_sequence, body, args, logs / f"pinned-{k}.log")
            figures = done["a" if side == "A" else "b"]["answers"]
            ok = [a.latency_s for a in figures if a.outcome == "200"]
            cores = done["a" if side == "A" else "b"]["server_cores"]
            print(f"round {k + 1} {'on-demand' if side == 'A' else 'pinned'}: {len(ok)}/{len(figures)} ok, p50 "
                  f"{ms(ok, 0.5):.1f} ms, p99 {ms(ok, 0.99):.1f} ms, server CPU {cores:.2f} cores",
                  flush=True)  # fmt: skip
        rounds.append(done)
    return rounds


def main(argv: Sequence[str] | None = None) -> int:
    args = settle(build_parser().parse_args(argv))
    error = usage_error(args)
    if error is not None:
        print(error, file=sys.stderr)
        return 2
    from service.core.samples import photo_like_jpegs

    began = time.perf_counter()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    body = photo_like_jpegs(1, (64, 64), seed=args.seed)[0]
    names, repo = build_models(args, work)
    cold_version = export_once(args.cold_arch, args.cold_input_size, args.cold_max_batch_size,
                               work / f"export-{args.cold_arch}-{args.cold_input_size}")  # fmt: skip

    first, size, served = probe(args, work, repo, names, cold_version, body)
    budget = int((args.capacity + 0.5) * size)
    print(f"one model charged {size / 1e6:.1f} MB (the first load, with onnxruntime's start: {first / 1e6:.1f} MB): "
          f"budget {budget / 1e6:.1f} MB", flush=True)  # fmt: skip
    cold = {"arch": args.cold_arch, "input_size": args.cold_input_size, "max_batch_size": args.cold_max_batch_size,
            "in_process": cold_in_process(cold_version, args.cold_max_batch_size, args.cold_repeats),
            "served": served, "triton": triton_load(args, cold_version, work)}  # fmt: skip
    cold["file_bytes"] = cold["in_process"]["file_bytes"]

    sequence = make_sequence(names, args)
    sequence_file = Path(args.write_sequence or work / "sequence.txt")
    sequence_file.write_text("".join(m + "\n" for _, m in sequence))
    top = names[: args.capacity]
    pinned = repository_of(work / "pinned", {n: (repo / n, on_demand_config(args.max_batch_size, pinned=True))
                                             for n in top})  # fmt: skip
    top_sequence = [(t, m) for t, m in sequence if m in top]
    print(f"{len(sequence)} requests over {len(names)} models ({len(top_sequence)} to the top {len(top)}); "
          f"sequence in {sequence_file}", flush=True)  # fmt: skip
    rounds = run_rounds(args, repo, pinned, sequence, top_sequence, body, budget, logs)

    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
        "models": args.models, "capacity": args.capacity, "arch": f"{args.arch} {args.input_size}x{args.input_size}",
        "rate": args.rate, "duration_s": args.duration_s, "scrape_s": args.scrape_s, "rounds": args.rounds,
        "popularity": args.popularity, "requests": len(sequence), "model_bytes": size, "first_model_bytes": first,
        "budget_bytes": budget, "sequence_file": str(sequence_file),
        "limits": {"hit_rate_points": args.hit_rate_points, "p99_ratio": args.p99_ratio,
                   "rss_tolerance": args.rss_tolerance},
    }  # fmt: skip
    results.update(judge(args, size, budget, sequence, rounds, cold))
    results["passed"] = all((results["correct"]["passed"], results["hit_rate"]["passed"],
                             results["p99_hits"]["passed"], results["memory"]["charged_passed"],
                             results["memory"]["rss_passed"]))  # fmt: skip
    results["wall_s"] = time.perf_counter() - began
    report(results)
    print(f"verdict: {'every target met' if results['passed'] else 'a target missed'} ({results['wall_s']:.0f} s)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(json_safe(results), indent=1))
        print(f"wrote {args.out}")
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
