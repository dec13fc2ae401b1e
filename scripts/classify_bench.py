"""Is ``visionserve classify`` the bottleneck? Two targets, each measured in interleaved rounds:

1. Through a server: ``classify --url`` over a folder of generated photo-like JPEGs reaches >= 0.9 of the load
   tester's closed-loop throughput (``loadtest --mode closed``) at the same concurrency, in images/s. ``classify``
   sends ``--images-per-request`` images per request (8 by default) where the load tester sends one, so it runs
   twice per round: with its default and with ``--images-per-request 1`` (the like-for-like ratio).
2. In this process: ``classify`` without ``--url`` reaches >= 0.9 of ``bench``'s pipeline figure (decode + run at
   the model's ``max_batch_size``, no HTTP) on the same images.

A round is: classify (default images per request), classify (1 per request), loadtest; then in-process classify,
bench. Each command runs as a subprocess, exactly as a user types it (the commands are printed). ``classify``'s
figure is its own summary line (the time from its first request to its last answer: Python start-up and model
loading not counted; its ramp-up is); the load tester's excludes its ``--warmup-s``. The verdicts are on the ratios
of the medians; each round's own ratio is printed too (on a shared machine the load moves between rounds).
Writes every round, the medians and the ratios to ``--json``. Exit code 0 when both targets hold, 1 when one
misses, 2 on a usage error.

    .venv/bin/python scripts/classify_bench.py --model resnet18 --json results/classify_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TARGET = 0.9
_SUMMARY = re.compile(r"classified (\d+) images in ([\d.]+) s \(([\d,.]+) images/s\): (\d+) ok, (\d+) failed")
_REQUESTS = re.compile(r"requests: (\d+) \((\d+) retries\)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet18", help="digits (trained, then exported) or a zoo architecture "
                   "exported with its initial weights, e.g. resnet18 (default: %(default)s)")  # fmt: skip
    p.add_argument("--repository", default=None, help="a repository already holding --model (default: build one "
                   "in a temporary folder)")  # fmt: skip
    p.add_argument("--checkpoint", default=None, help="digits without --repository: export this checkpoint "
                   "(default: checkpoints/digits.pt when it exists, else train one, about 30 s)")  # fmt: skip
    p.add_argument("--images", type=int, default=2000, help="generated 500x375 JPEGs (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight, classify and load tester "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds per target (default: %(default)s)")
    p.add_argument("--duration-s", type=float, default=15.0, help="load tester: measured seconds per round "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--warmup-s", type=float, default=2.0, help="load tester: seconds before measuring "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--bench-seconds", type=float, default=10.0, help="bench: seconds measuring the pipeline "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--workers", type=int, default=0, help="server front ends; 0: the server's choice "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--json", default=None, help="write every figure to this file (default: none)")
    return p


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.2f}] {message}", flush=True)


def visionserve() -> list[str]:
    entry = Path(sys.executable).parent / "visionserve"
    return [str(entry)] if entry.exists() else [sys.executable, "-m", "service.cli"]


def _shown(cmd: Sequence[str]) -> str:
    return " ".join(["visionserve", *cmd[len(visionserve()) :]] if cmd[0] == visionserve()[0] else cmd)


def run_command(cmd: list[str], ok: tuple[int, ...] = (0,)) -> tuple[subprocess.CompletedProcess[str], float, float]:
    """(the finished process, its wall seconds, its CPU seconds with its children's)."""
    say(f"$ {_shown(cmd)}")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall_s = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode not in ok:
        raise RuntimeError(f"{_shown(cmd)} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    cpu_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return done, wall_s, cpu_s


def generate_images(folder: Path, count: int) -> dict[str, Any]:
    """``count`` photo-like 500x375 JPEGs (smooth fields, shapes, noise; quality 90) written into ``folder``."""
    from service.core.samples import photo_like_jpegs

    folder.mkdir(parents=True, exist_ok=True)
    sizes: list[int] = []
    for seed, start in enumerate(range(0, count, 100)):
        for i, data in enumerate(photo_like_jpegs(min(100, count - start), seed=seed)):
            (folder / f"img-{start + i:05d}.jpg").write_bytes(data)
            sizes.append(len(data))
    return {"count": count, "size": "500x375", "mean_kb": statistics.mean(sizes) / 1024,
            "min_kb": min(sizes) / 1024, "max_kb": max(sizes) / 1024}  # fmt: skip


def prepare_repository(args: argparse.Namespace, scratch: Path) -> Path:
    if args.repository:
        return Path(args.repository)
    repository = scratch / "repo"
    if args.model == "digits":
        checkpoint = Path(args.checkpoint) if args.checkpoint else ROOT / "checkpoints" / "digits.pt"
        if args.checkpoint is None and not checkpoint.exists():
            checkpoint = scratch / "digits.pt"
            run_command([*visionserve(), "train", "--no-progress", "--out", str(checkpoint)])
        source = ["--checkpoint", str(checkpoint)]
    else:
        source = ["--arch", args.model]
    run_command([*visionserve(), "export", "--no-progress", *source, "--name", args.model,
                 "--repository", str(repository), "--no-latency"])  # fmt: skip
    return repository


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def started_server(repository: Path, workers: int, log: Path) -> Iterator[str]:
    """A server on a free port of 127.0.0.1, ready; SIGTERM on the way out, whatever happened."""
    import httpx

    url = f"http://127.0.0.1:{_free_port()}"
    cmd = [*visionserve(), "serve", "--repository", str(repository), "--host", "127.0.0.1", "--port",
           url.rsplit(":", 1)[1], "--grpc-port", "0", "--workers", str(workers)]  # fmt: skip
    say(f"$ {_shown(cmd)}")
    with open(log, "wb") as out:  # a file: a pipe nobody reads would fill up and stall the server
        process = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with {process.returncode}: {log.read_text()[-2000:]}")
            try:
                if httpx.get(url + "/v2/health/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server was not ready within 300 s")
            time.sleep(0.3)
        say(f"server ready at {url} (pid {process.pid})")
        yield url
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        say(f"server stopped (exit code {process.returncode})")


def classify(model: str, folder: Path, out: Path, *, url: str | None, repository: Path, concurrency: int,
             per_request: int | None) -> dict[str, Any]:  # fmt: skip
    """One ``visionserve classify`` run: its own summary figures, with wall and CPU time of the whole process."""
    cmd = [*visionserve(), "classify", "--no-progress", "--model", model, str(folder), "--out", str(out),
           "--overwrite"]  # fmt: skip
    if url:
        cmd += ["--url", url, "--concurrency", str(concurrency)]
        cmd += ["--images-per-request", str(per_request)] if per_request else []
    else:
        cmd += ["--repository", str(repository)]
    done, wall_s, cpu_s = run_command(cmd, ok=(0, 1))  # 1: some image failed, counted below
    summary, requests = _SUMMARY.search(done.stderr), _REQUESTS.search(done.stderr)
    if summary is None or requests is None:
        raise RuntimeError(f"no summary in classify's output:\n{done.stderr[-3000:]}")
    images, rate, failed = int(summary[1]), float(summary[3].replace(",", "")), int(summary[5])
    seconds = images / rate
    sent = int(requests[1])
    result = {"command": _shown(cmd), "images": images, "failed": failed, "seconds": seconds,
              "images_per_s": rate, "requests": sent, "retries": int(requests[2]), "requests_per_s": sent / seconds,
              "process_wall_s": wall_s, "process_cpu_s": cpu_s}  # fmt: skip
    say(f"  classify: {rate:.1f} images/s, {result['requests_per_s']:.1f} requests/s, {images} images in "
        f"{seconds:.1f} s ({failed} failed); process {wall_s:.1f} s wall, {cpu_s:.1f} s CPU")  # fmt: skip
    return result


def loadtest(model: str, folder: Path, url: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [*visionserve(), "loadtest", "--no-progress", "--url", url, "--model", model, "--mode", "closed",
           "--concurrency", str(args.concurrency), "--images", str(folder), "--duration", str(args.duration_s),
           "--warmup", str(args.warmup_s), "--json"]  # fmt: skip
    done, wall_s, cpu_s = run_command(cmd)
    step = json.loads(done.stdout.strip().splitlines()[-1])["steps"][0]
    result = {"command": _shown(cmd), "images_per_s": step["images_per_s"], "requests_per_s": step["requests_per_s"],
              "requests": step["requests"], "errors": sum(step["errors"].values()),
              "client_cpu_share": step["client_cpu"], "p50_ms": step["latency_ms"]["p50"],
              "p99_ms": step["latency_ms"]["p99"], "process_wall_s": wall_s, "process_cpu_s": cpu_s}  # fmt: skip
    say(f"  loadtest: {result['images_per_s']:.1f} images/s, {result['requests_per_s']:.1f} requests/s "
        f"({result['errors']} errors, p50 {result['p50_ms']:.0f} ms); busiest load process "
        f"{100 * result['client_cpu_share']:.0f}% of a core")  # fmt: skip
    return result


def bench(model: str, folder: Path, repository: Path, args: argparse.Namespace) -> dict[str, Any]:
    config = tomllib.loads((repository / model / "config.toml").read_text())
    batch = int(config.get("max_batch_size", 32))  # what in-process classify stacks: the same batch
    cmd = [*visionserve(), "bench", "--no-progress", "--model", model, "--repository", str(repository),
           "--figures", "pipeline", "--batch-sizes", str(batch), "--images", str(folder),
           "--seconds", str(args.bench_seconds), "--json"]  # fmt: skip
    done, wall_s, _cpu_s = run_command(cmd)
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    result = {"command": _shown(cmd), "images_per_s": figures["pipeline_images_per_s"], "batch": batch,
              "runtime": figures["runtime"], "device": figures["device"],
              "decode_workers": figures["decode_workers"], "process_wall_s": wall_s}  # fmt: skip
    say(f"  bench pipeline: {result['images_per_s']:.1f} images/s ({result['runtime']} on {result['device']}, "
        f"batch {batch}, {result['decode_workers']} decode workers)")  # fmt: skip
    return result


def _median(rounds: list[dict[str, Any]], key: str, field: str) -> float:
    return statistics.median(r[key][field] for r in rounds)


def summarise_server(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    for r in rounds:  # each round's own ratios too: on a shared machine the load moves between rounds
        r["ratio_images"] = r["classify"]["images_per_s"] / r["loadtest"]["images_per_s"]
        r["ratio_like_for_like"] = r["classify_1"]["images_per_s"] / r["loadtest"]["images_per_s"]
    medians = {key: {f: _median(rounds, key, f) for f in ("images_per_s", "requests_per_s")}
               for key in ("classify", "classify_1", "loadtest")}  # fmt: skip
    base = medians["loadtest"]["images_per_s"]
    ratio = medians["classify"]["images_per_s"] / base
    like = medians["classify_1"]["images_per_s"] / base
    return {"rounds": rounds, "medians": medians, "ratio_images": ratio, "ratio_like_for_like": like,
            "target": TARGET, "passed": ratio >= TARGET}  # fmt: skip


def summarise_local(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    for r in rounds:
        r["ratio_images"] = r["classify"]["images_per_s"] / r["bench"]["images_per_s"]
    medians = {key: _median(rounds, key, "images_per_s") for key in ("classify", "bench")}
    ratio = medians["classify"] / medians["bench"]
    return {"rounds": rounds, "medians_images_per_s": medians, "ratio_images": ratio, "target": TARGET,
            "passed": ratio >= TARGET}  # fmt: skip


def report(results: dict[str, Any]) -> None:
    server, local = results["server"], results["in_process"]
    print(f"\n{results['model']}, {results['images']['count']} images of {results['images']['mean_kb']:.0f} KB, "
          f"concurrency {results['config']['concurrency']}")  # fmt: skip
    print("through a server (images/s | requests/s):")
    print(f"  {'round':>6}  {'classify':>17}  {'classify, 1/req':>17}  {'loadtest':>17}  ratios (default, 1/req)")
    for k, r in enumerate(server["rounds"], 1):
        cells = [f"{r[key]['images_per_s']:7.1f} | {r[key]['requests_per_s']:7.1f}"
                 for key in ("classify", "classify_1", "loadtest")]  # fmt: skip
        print(f"  {k:>6}  " + "  ".join(cells) + f"  {r['ratio_images']:.3f}, {r['ratio_like_for_like']:.3f}")
    m = server["medians"]
    cells = [f"{m[key]['images_per_s']:7.1f} | {m[key]['requests_per_s']:7.1f}"
             for key in ("classify", "classify_1", "loadtest")]  # fmt: skip
    print(f"  {'median':>6}  " + "  ".join(cells))
    verdict = "holds" if server["passed"] else "MISSED"
    print(f"  classify / loadtest (images/s): {server['ratio_images']:.3f} (target >= {TARGET}: {verdict}); "
          f"like for like, 1 image per request: {server['ratio_like_for_like']:.3f}")  # fmt: skip
    print("in this process (images/s):")
    for k, r in enumerate(local["rounds"], 1):
        print(f"  round {k}: classify {r['classify']['images_per_s']:7.1f}  bench pipeline "
              f"{r['bench']['images_per_s']:7.1f}  ratio {r['ratio_images']:.3f}")  # fmt: skip
    lm = local["medians_images_per_s"]
    verdict = "holds" if local["passed"] else "MISSED"
    print(f"  median:  classify {lm['classify']:7.1f}  bench pipeline {lm['bench']:7.1f}")
    print(f"  classify / bench pipeline: {local['ratio_images']:.3f} (target >= {TARGET}: {verdict})")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if min(args.images, args.concurrency, args.rounds) < 1 or min(args.duration_s, args.bench_seconds) <= 0:
        print("--images, --concurrency and --rounds must be >= 1; --duration-s and --bench-seconds > 0",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.repository and not (Path(args.repository) / args.model).is_dir():
        print(f"--repository {args.repository} holds no model {args.model}", file=sys.stderr)
        return 2
    results: dict[str, Any] = {"model": args.model, "config": vars(args), "cpus": os.cpu_count(),
                               "date": time.strftime("%Y-%m-%d %H:%M:%S"), "load_before": os.getloadavg()}  # fmt: skip
    scratch = Path(tempfile.mkdtemp(prefix="vs-classify-bench-"))
    try:
        repository = prepare_repository(args, scratch)
        say(f"generating {args.images} JPEGs")
        folder = scratch / "images"
        results["images"] = generate_images(folder, args.images)
        say(f"{args.images} JPEGs in {folder}: {results['images']['mean_kb']:.1f} KB on average")
        preds = scratch / "preds.csv"
        rounds: list[dict[str, Any]] = []
        with started_server(repository, args.workers, scratch / "server.log") as url:
            for k in range(1, args.rounds + 1):
                say(f"server round {k}/{args.rounds}")
                common = {"url": url, "repository": repository, "concurrency": args.concurrency}
                rounds.append({
                    "classify": classify(args.model, folder, preds, per_request=None, **common),
                    "classify_1": classify(args.model, folder, preds, per_request=1, **common),
                    "loadtest": loadtest(args.model, folder, url, args),
                })  # fmt: skip
        results["server"] = summarise_server(rounds)
        local: list[dict[str, Any]] = []
        for k in range(1, args.rounds + 1):
            say(f"in-process round {k}/{args.rounds}")
            local.append({
                "classify": classify(args.model, folder, preds, url=None, repository=repository,
                                     concurrency=args.concurrency, per_request=None),
                "bench": bench(args.model, folder, repository, args),
            })  # fmt: skip
        results["in_process"] = summarise_local(local)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    results["load_after"] = os.getloadavg()
    results["passed"] = results["server"]["passed"] and results["in_process"]["passed"]
    report(results)
    before, after = (" ".join(f"{x:.2f}" for x in results[k]) for k in ("load_before", "load_after"))
    print(f"load average (1, 5, 15 min): before {before}, after {after}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
        print(f"wrote {args.json}")
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
