"""gRPC against HTTP on one server, in one run: the issue's two targets.

1. Throughput: ``ModelInfer`` with ``raw_input_contents`` against HTTP v2 infer with the binary tensor extension
   (both send the IMAGE input and ask for the classification extension), closed loop at ``--concurrency`` (8),
   on ``--model`` (resnet18). Target: gRPC within 5% of HTTP.
2. Round trip: the same two at concurrency 1 on ``--noop-model`` (a model whose config.toml says
   ``backend = "noop"``: no model work, so the figure is the server's own cost). Target: gRPC no slower.

The two protocols take turns (HTTP, gRPC, HTTP, gRPC, ... ``--rounds`` times) so that drift in the machine's speed
falls on both alike; each figure is the median of its rounds. Each measurement is one ``visionserve loadtest
--json`` run. Against a running server (``--url``, ``--grpc-url``), or one this script starts on free ports
(``--repository``)::

    .venv/bin/python scripts/grpc_vs_http.py --repository model_repository --model resnet18 --noop-model noop
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

PROTOCOLS = ("v2", "grpc")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="HTTP address (default: %(default)s)")
    p.add_argument("--grpc-url", default="127.0.0.1:8001", help="gRPC address (default: %(default)s)")
    p.add_argument("--repository", default=None, help="start a server on this repository (default: use --url)")
    p.add_argument("--workers", type=int, default=1, help="with --repository: front-end processes (default: 1)")
    p.add_argument("--model", default="resnet18", help="throughput model (default: %(default)s)")
    p.add_argument("--noop-model", default=None, help="round-trip model, backend noop (default: none, skipped)")
    p.add_argument("--concurrency", type=int, default=8, help="throughput clients (default: %(default)s)")
    p.add_argument("--duration", type=float, default=20.0, help="measured seconds per run (default: %(default)s)")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds before measuring (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="runs per protocol, alternating (default: %(default)s)")
    p.add_argument("--image-size", default="500x375", help="generated JPEGs, WxH (default: %(default)s)")
    p.add_argument("--processes", type=int, default=1, help="load-generating processes (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object (default: text)")
    return p


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def _server(repository: str, workers: int) -> Iterator[tuple[str, str]]:
    """A server on free ports on 127.0.0.1, ready, stopped on the way out."""
    import httpx

    port, grpc_port = _free_port(), _free_port()
    cmd = [sys.executable, "-m", "service.cli", "serve", "--repository", repository, "--host", "127.0.0.1",
           "--port", str(port), "--grpc-port", str(grpc_port), "--workers", str(workers)]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    # The server's log goes to a file: a pipe nobody reads would fill up and stall the server mid-measurement.
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while True:
                if process.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"the server exited with {process.returncode}: {log.read().decode()[-2000:]}")
                try:
                    if httpx.get(url + "/v2/health/ready", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("the server was not ready within 300 s")
                time.sleep(0.3)
            yield url, f"127.0.0.1:{grpc_port}"
        finally:
            process.terminate()
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def measure(args: argparse.Namespace, url: str, grpc_url: str, model: str, protocol: str, concurrency: int) -> dict:
    """One loadtest run; its single step's summary."""
    cmd = [sys.executable, "-m", "service.cli", "loadtest", "--url", url, "--grpc-url", grpc_url, "--model", model,
           "--protocol", protocol, "--mode", "closed", "--concurrency", str(concurrency), "--duration",
           str(args.duration), "--warmup", str(args.warmup), "--image-size", args.image_size, "--processes",
           str(args.processes), "--json", "--no-progress"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"loadtest {protocol} on {model} failed ({done.returncode}): {done.stderr[-2000:]}")
    step: dict = json.loads(done.stdout)["steps"][0]
    return step


def compare(args: argparse.Namespace, url: str, grpc_url: str, model: str, concurrency: int) -> dict:
    """Alternating rounds of both protocols; medians of requests/s and of p50 latency, and their ratios."""
    runs: dict[str, list[dict]] = {p: [] for p in PROTOCOLS}
    for _ in range(args.rounds):
        for protocol in PROTOCOLS:
            runs[protocol].append(measure(args, url, grpc_url, model, protocol, concurrency))
    out: dict = {"model": model, "concurrency": concurrency}
    for protocol, steps in runs.items():
        out[protocol] = {
            "requests_per_s": statistics.median(s["requests_per_s"] for s in steps),
            "p50_ms": statistics.median(s["latency_ms"]["p50"] for s in steps),
            "errors": sum(sum(s["errors"].values()) for s in steps),
            "rounds": [round(s["requests_per_s"], 1) for s in steps],
        }
    out["throughput_ratio"] = out["grpc"]["requests_per_s"] / out["v2"]["requests_per_s"]
    out["p50_ratio"] = out["grpc"]["p50_ms"] / out["v2"]["p50_ms"]
    return out


def _print(result: dict, title: str) -> None:
    print(f"{title}: {result['model']} at c={result['concurrency']}")
    for protocol, name in (("v2", "HTTP binary v2"), ("grpc", "gRPC raw")):
        r = result[protocol]
        print(f"  {name:>15}: {r['requests_per_s']:8.1f} req/s, p50 {r['p50_ms']:7.2f} ms, errors {r['errors']}"
              f"  (rounds {r['rounds']})")  # fmt: skip
    print(f"  gRPC / HTTP: throughput {result['throughput_ratio']:.3f}, p50 latency {result['p50_ratio']:.3f}")


def run(args: argparse.Namespace, url: str, grpc_url: str) -> dict:
    results = {"throughput": compare(args, url, grpc_url, args.model, args.concurrency)}
    if args.noop_model:
        results["round_trip"] = compare(args, url, grpc_url, args.noop_model, 1)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.repository is not None:
        if not Path(args.repository).is_dir():
            print(f"--repository {args.repository}: no such folder", file=sys.stderr)
            return 2
        with _server(args.repository, args.workers) as (url, grpc_url):
            results = run(args, url, grpc_url)
    else:
        results = run(args, args.url.rstrip("/"), args.grpc_url)
    if args.json:
        print(json.dumps(results))
        return 0
    _print(results["throughput"], "throughput (target: gRPC within 5% of HTTP, ratio >= 0.95)")
    if "round_trip" in results:
        _print(results["round_trip"], "round trip (target: gRPC p50 no slower, ratio <= 1.0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
