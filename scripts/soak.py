"""Soak: a long open loop at a fixed share of capacity, good and bad inputs mixed, watching the server's memory.

Criteria (from the reliability issue), judged after ``--warmup-s``:
- memory: the server's RSS (supervisor, engine, front ends and the rest of its process tree, summed) grows by less
  than ``--max-rss-growth-mb`` (50) from the end of the warm-up to its highest point;
- errors: none apart from the bad inputs' 4xx (a good request answered anything but 200, or a bad one answered 5xx,
  timed out or lost its connection, is an error);
- latency: the p99 of good requests in the last minute is within ``--max-p99-change`` (20%) of the first minute's.

Steps: start a server on free ports (or use ``--url`` and ``--server-pid``), measure its capacity with a short closed
loop of good requests (unless ``--rate``), then run the open loop of ``loadtest/openloop.py`` at ``--load`` x that
capacity while a thread reads the server tree's RSS from /proc once a second. A progress line every 10 s. Writes
``soak.json`` (every figure, the RSS series, latency per minute and per 10 s), ``soak.png`` (RSS and latency over
time) and, for a server it started, ``server.log`` into ``--out``. Exit code 0 when all criteria pass, 1 otherwise.

The full soak (10 minutes at 80% of capacity; trains and exports digits first when no ``--repository``)::

    .venv/bin/python scripts/soak.py --out results/soak
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.http1 import Http1Client
from loadtest.openloop import Record, Request, percentile, run_open_loop

ROOT = Path(__file__).resolve().parent.parent

KB_PER_MB = 1024
ROLES = {
    "service.frontend.server": "frontend",
    "service.engine.process": "engine",
    "service.transport.janitor": "janitor",
    "multiprocessing.resource_tracker": "resource-tracker",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running server to soak (default: start one on --repository)")
    p.add_argument("--server-pid", type=int, default=None, help="with --url: the server's top process, for RSS "
                   "(default: none; required with --url)")  # fmt: skip
    p.add_argument("--repository", default=None, help="start a server on this repository (default: train digits "
                   "and export it into a temporary folder, about 30 s)")  # fmt: skip
    p.add_argument("--model", default="digits", help="model to send images to (default: %(default)s)")
    p.add_argument("--workers", type=int, default=0, help="front ends of a started server; 0: the server's own "
                   "choice (default: %(default)s)")  # fmt: skip
    p.add_argument("--duration-s", type=float, default=600.0, help="open-loop seconds (default: %(default)s)")
    p.add_argument("--warmup-s", type=float, default=60.0, help="first seconds not judged (default: %(default)s)")
    p.add_argument("--load", type=float, default=0.8, help="share of measured capacity (default: %(default)s)")
    p.add_argument("--rate", type=float, default=None, help="requests/s, skips measuring capacity (default: none)")
    p.add_argument("--capacity-s", type=float, default=5.0, help="closed-loop seconds measuring capacity, after 1 s "
                   "not counted (default: %(default)s)")  # fmt: skip
    p.add_argument("--capacity-concurrency", type=int, default=16, help="closed-loop clients (default: %(default)s)")
    p.add_argument("--bad-fraction", type=float, default=0.1, help="share of bad inputs (default: %(default)s)")
    p.add_argument("--timeout-s", type=float, default=30.0, help="per-request timeout (default: %(default)s)")
    p.add_argument("--max-rss-growth-mb", type=float, default=50.0, help="memory criterion (default: %(default)s)")
    p.add_argument("--max-p99-change", type=float, default=0.2, help="latency criterion: |last/first - 1| of the "
                   "minute p99s (default: %(default)s)")  # fmt: skip
    p.add_argument("--out", default="results/soak", help="output folder (default: %(default)s)")
    return p


# ---- inputs -------------------------------------------------------------------------------------------------------


def _image_bytes(image: Any, fmt: str, **params: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **params)
    return buf.getvalue()


def build_mix(model: str, bad_fraction: float, size: int = 1000) -> list[Request]:
    """``size`` requests, the bad ones spread evenly (every 1/bad_fraction-th) and each kind taken in turn, so that
    any stretch of the run holds the same mix."""
    from PIL import Image

    digit3, digit6 = (ROOT / "examples" / "digit-3.png").read_bytes(), (ROOT / "examples" / "digit-6.png").read_bytes()
    with Image.open(io.BytesIO(digit3)) as im:
        jpeg = _image_bytes(im.convert("RGB").resize((64, 64)), "JPEG", quality=90)
    rng = random.Random(0)
    classify = f"/v1/models/{model}/classify"
    infer = f"/v2/models/{model}/infer"
    v2 = {"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1], "data": [base64.b64encode(digit6).decode()]}]}
    good = [
        Request(classify, digit3, {"Content-Type": "image/png"}, "good:png"),
        Request(classify, digit6, {"Content-Type": "image/png"}, "good:png"),
        Request(classify, jpeg, {"Content-Type": "image/jpeg"}, "good:jpeg"),
        Request(infer, json.dumps(v2).encode(), {"Content-Type": "application/json"}, "good:v2-json"),
    ]
    png, jpg, js = {"Content-Type": "image/png"}, {"Content-Type": "image/jpeg"}, {"Content-Type": "application/json"}
    bad = [
        Request(classify, b"\x89PNG\r\n\x1a\n" + rng.randbytes(2000), png, "bad:corrupt-png"),
        Request(classify, jpeg[: len(jpeg) // 2], jpg, "bad:truncated-jpeg"),
        Request(classify, digit3, {"Content-Type": "text/plain"}, "bad:wrong-content-type"),
        Request(f"/v1/models/{model}-no-such-model/classify", digit6, png, "bad:unknown-model"),
        Request(infer, b'{"inputs": [{"name": "IMAGE", not json', js, "bad:v2-not-json"),
    ]
    out: list[Request] = []
    taken = {"good": 0, "bad": 0}
    for i in range(size):
        kind = "bad" if math.floor((i + 1) * bad_fraction) > math.floor(i * bad_fraction) else "good"
        kinds = bad if kind == "bad" else good
        out.append(kinds[taken[kind] % len(kinds)])
        taken[kind] += 1
    return out


# ---- the server ---------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def build_repository(folder: Path) -> Path:
    """digits trained (4 epochs) and exported into ``folder``/repo."""
    from export.exporter import ExportRequest, export_model
    from export.sources import from_checkpoint
    from models.train import TrainConfig, train

    checkpoint = folder / "digits.pt"
    train(TrainConfig(epochs=4, out=str(checkpoint)))
    digits = from_checkpoint(checkpoint)
    repository = folder / "repo"
    export_model(digits.eager, digits.spec, ExportRequest(name="digits", repository=str(repository), latency=False))
    return repository


@contextmanager
def started_server(repository: Path, workers: int, log: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A server on a free port on 127.0.0.1, ready; SIGTERM on the way out (its exit code is then the process's)."""
    import httpx

    port = _free_port()
    cmd = [sys.executable, "-m", "service.cli", "serve", "--repository", str(repository), "--host", "127.0.0.1",
           "--port", str(port), "--grpc-port", "0", "--workers", str(workers)]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    # The log goes to a file: a pipe nobody reads would fill up and stall the server mid-soak.
    with open(log, "wb") as out:
        process = subprocess.Popen(
            cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
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
        yield url, process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


# ---- memory -------------------------------------------------------------------------------------------------------


def _kb_field(path: Path, name: str) -> int:
    for line in path.read_text().splitlines():
        if line.startswith(name):
            return int(line.split()[1])
    return 0


def tree_memory_kb(root: int) -> dict[int, tuple[str, int, int]]:
    """pid -> (role, VmRSS kB, Pss kB) for ``root`` and its live descendants (found by the ppid in /proc/*/stat)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    family, grew = {root}, True
    while grew:
        grew = False
        for child, parent in parents.items():
            if parent in family and child not in family:
                family.add(child)
                grew = True
    out = {}
    for pid in family:
        proc = Path(f"/proc/{pid}")
        try:
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            rss = _kb_field(proc / "status", "VmRSS:")
            pss = _kb_field(proc / "smaps_rollup", "Pss:")
        except OSError:  # gone between the listing and the read
            continue
        role = "supervisor" if pid == root else next((r for m, r in ROLES.items() if m in command), "other")
        out[pid] = (role, rss, pss)
    return out


@dataclass
class MemorySampler:
    """Samples the server tree's memory once a second on its own thread (the event loop sends the requests)."""

    pid: int
    start: float  # time.perf_counter() of the open loop's start
    samples: list[dict[str, Any]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def sample(self) -> dict[str, Any]:
        tree = tree_memory_kb(self.pid)
        roles: Counter[str] = Counter()
        for role, rss, _ in tree.values():
            roles[role] += rss
        return {
            "t_s": round(time.perf_counter() - self.start, 3),
            "rss_mb": sum(rss for _, rss, _ in tree.values()) / KB_PER_MB,
            "pss_mb": sum(pss for _, _, pss in tree.values()) / KB_PER_MB,
            "rss_mb_by_role": {role: kb / KB_PER_MB for role, kb in sorted(roles.items())},
            "processes": len(tree),
        }

    def _run(self) -> None:
        next_at = time.perf_counter()
        while not self._stop.is_set():
            self.samples.append(self.sample())
            next_at += 1.0
            self._stop.wait(max(0.0, next_at - time.perf_counter()))

    def __enter__(self) -> MemorySampler:
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.samples.append(self.sample())  # the final figure, at the end of the load

    def latest_mb(self) -> float:
        return float(self.samples[-1]["rss_mb"]) if self.samples else float("nan")


# ---- load ---------------------------------------------------------------------------------------------------------


async def measure_capacity(url: str, requests: list[Request], seconds: float, concurrency: int) -> dict[str, Any]:
    """Closed loop of good requests: ``concurrency`` clients, each sending its next request on an answer; 1 s not
    counted, then ``seconds`` counted. Capacity = 200 answers per second."""
    client = Http1Client(url, 30.0)
    statuses: Counter[str] = Counter()
    begin = time.perf_counter()
    counted_from, until = begin + 1.0, begin + 1.0 + seconds
    turn = 0

    async def one_client() -> None:
        nonlocal turn
        while time.perf_counter() < until:
            request = requests[turn % len(requests)]
            turn += 1
            try:
                outcome = str(await client.post(request.path, request.body, request.headers))
            except TimeoutError:
                outcome = "timeout"
            except Exception as exc:  # ConnectionFailed and the like: counted, never fatal to the measurement
                outcome = type(exc).__name__
            if time.perf_counter() >= counted_from:
                statuses[outcome] += 1

    await asyncio.gather(*(one_client() for _ in range(concurrency)))
    await client.aclose()
    return {"requests_per_s": statuses["200"] / seconds, "seconds": seconds, "concurrency": concurrency,
            "outcomes": dict(statuses)}  # fmt: skip


@dataclass
class Live:
    """What the progress line shows, counted as requests end."""

    sent: int = 0
    answered: int = 0
    failed: int = 0
    window_ok_s: list[float] = field(default_factory=list)  # service times of 200s since the last progress line


async def soak_loop(
    url: str, requests: list[Request], args: argparse.Namespace, rate: float, sampler: MemorySampler | None
) -> list[Record]:
    live = Live()

    def on_tick(elapsed_s: float) -> None:
        if round(elapsed_s) % 10 != 0:
            return
        window, live.window_ok_s = live.window_ok_s, []
        p99 = percentile(window, 0.99) * 1000
        rss = sampler.latest_mb() if sampler is not None else float("nan")
        phase = "warm-up" if elapsed_s < args.warmup_s else "judged"
        print(f"  {elapsed_s:5.0f} s ({phase}): sent {live.sent}, answered {live.answered}, failed {live.failed}, "
              f"RSS {rss:7.1f} MB, last-10s p99 (200s, from send) {p99:7.1f} ms", flush=True)  # fmt: skip

    def on_record(record: Record) -> None:
        live.sent += 1
        if record.outcome in ("timeout", "connection", "client-overflow"):
            live.failed += 1
            return
        live.answered += 1
        if record.outcome == "200":
            live.window_ok_s.append(record.service_s)

    return await run_open_loop(url, requests, rate=rate, duration_s=args.duration_s, timeout_s=args.timeout_s,
                               on_tick=on_tick, on_record=on_record)  # fmt: skip


# ---- results ------------------------------------------------------------------------------------------------------


def _latency_windows(good: list[Record], width_s: float, duration_s: float) -> list[dict[str, Any]]:
    buckets: dict[int, list[float]] = {}
    for r in good:
        buckets.setdefault(int(r.due_s // width_s), []).append(r.latency_s)
    out = []
    for i in range(math.ceil(duration_s / width_s)):
        values = buckets.get(i, [])
        out.append({"start_s": i * width_s, "count": len(values), "p50_ms": percentile(values, 0.5) * 1000,
                    "p99_ms": percentile(values, 0.99) * 1000})  # fmt: skip
    return out


def _is_error(r: Record) -> bool:
    if r.tag.startswith("good"):
        return r.outcome != "200"
    return not (r.outcome.isdigit() and int(r.outcome) < 500)


def summarise(records: list[Record], samples: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    by_tag: dict[str, Counter[str]] = {}
    for r in records:
        by_tag.setdefault(r.tag, Counter())[r.outcome] += 1
    errors = Counter(f"{r.tag} {r.outcome}" for r in records if _is_error(r))
    good_ok = [r for r in records if r.tag.startswith("good") and r.outcome == "200"]
    # Windows for the p99 criterion: the first and last minute after the warm-up, shorter for a short run so that
    # the two never overlap.
    window_s = min(60.0, (args.duration_s - args.warmup_s) / 2)
    first = [r.latency_s for r in good_ok if args.warmup_s <= r.due_s < args.warmup_s + window_s]
    last = [r.latency_s for r in good_ok if args.duration_s - window_s <= r.due_s]
    p99_first, p99_last = percentile(first, 0.99) * 1000, percentile(last, 0.99) * 1000
    ratio = p99_last / p99_first if first and last else float("nan")

    judged = [s for s in samples if s["t_s"] >= args.warmup_s]
    before = [s for s in samples if s["t_s"] <= args.warmup_s]
    at_warmup = (before[-1] if before else judged[0])["rss_mb"] if samples else float("nan")
    rss_max = max(s["rss_mb"] for s in judged) if judged else float("nan")
    rss_final = samples[-1]["rss_mb"] if samples else float("nan")
    growth = rss_max - at_warmup
    lag = [r.sent_s - r.due_s for r in records]

    criteria = {
        "rss_growth": {"value_mb": growth, "limit_mb": args.max_rss_growth_mb,
                       "passed": growth < args.max_rss_growth_mb},
        "errors": {"value": sum(errors.values()), "limit": 0, "passed": not errors},
        "p99_stable": {"first_ms": p99_first, "last_ms": p99_last, "ratio": ratio, "limit": args.max_p99_change,
                       "passed": abs(ratio - 1) <= args.max_p99_change},
    }  # fmt: skip
    return {
        "requests": {"count": len(records), "by_tag": {t: dict(c) for t, c in sorted(by_tag.items())}},
        "errors": {"count": sum(errors.values()), "by_kind": dict(errors)},
        "client_lag_ms": {
            "p50": percentile(lag, 0.5) * 1000,
            "p99": percentile(lag, 0.99) * 1000,
            "max": max(lag, default=float("nan")) * 1000,
        },
        "latency": {
            "of": "good requests answered 200, from the time each was due",
            "per_minute": _latency_windows(good_ok, 60.0, args.duration_s),
            "per_10s": _latency_windows(good_ok, 10.0, args.duration_s),
            "criterion_window_s": window_s,
        },
        "rss": {
            "at_warmup_end_mb": at_warmup,
            "max_after_warmup_mb": rss_max,
            "final_mb": rss_final,
            "growth_max_mb": growth,
            "growth_final_mb": rss_final - at_warmup,
            "series": samples,
        },
        "criteria": criteria,
        "passed": all(c["passed"] for c in criteria.values()),
    }


def plot(results: dict[str, Any], path: Path, warmup_s: float) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt

    samples, rss = results["rss"]["series"], results["rss"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    t = [s["t_s"] for s in samples]
    # Change since the first sample, absolute figures in the labels: on one absolute scale a 1.4 GB tree flattens
    # every line, and growth is what the soak is after.
    # PSS stays out of the plot (it is in soak.json): it falls whenever another process on the machine maps the
    # same libraries, so on a shared machine it moves with the neighbours, not with the server.
    lines = {"RSS, whole tree": [s["rss_mb"] for s in samples]}
    for role in sorted({r for s in samples for r in s["rss_mb_by_role"]}):
        lines[f"RSS, {role}"] = [s["rss_mb_by_role"].get(role, 0.0) for s in samples]
    for i, (name, values) in enumerate(lines.items()):
        style = {"linewidth": 2.0} if i == 0 else {"linewidth": 1.0, "alpha": 0.8}
        top.plot(t, [v - values[0] for v in values], label=f"{name} ({values[0]:.0f} MB at start)", **style)
    limit = rss["at_warmup_end_mb"] - samples[0]["rss_mb"] + results["criteria"]["rss_growth"]["limit_mb"]
    top.axhline(limit, color="red", linestyle=":", linewidth=1, label="limit: warm-up end + growth limit")
    top.set_ylabel("memory change since start (MB)")
    top.set_title(f"server memory; RSS growth after warm-up {rss['growth_max_mb']:+.1f} MB")
    windows = [w for w in results["latency"]["per_10s"] if w["count"]]
    x = [w["start_s"] + 5 for w in windows]
    bottom.plot(x, [w["p50_ms"] for w in windows], marker="o", markersize=3, label="p50")
    bottom.plot(x, [w["p99_ms"] for w in windows], marker="o", markersize=3, label="p99")
    bottom.set_yscale("log")
    bottom.set_ylabel("latency of good requests (ms, log)")
    bottom.set_xlabel("seconds into the open loop")
    bottom.set_title("latency per 10 s window")
    for ax in (top, bottom):
        ax.axvspan(0, warmup_s, color="grey", alpha=0.15, label="warm-up")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(results: dict[str, Any]) -> None:
    print("\noutcomes per tag:")
    for tag, outcomes in results["requests"]["by_tag"].items():
        print(f"  {tag:<24} " + ", ".join(f"{o}: {n}" for o, n in sorted(outcomes.items())))
    print("latency of good requests per minute (ms):")
    for i, w in enumerate(results["latency"]["per_minute"]):
        print(f"  minute {i + 1:>2}: {w['count']:>7} requests, p50 {w['p50_ms']:8.2f}, p99 {w['p99_ms']:8.2f}")
    rss, lag = results["rss"], results["client_lag_ms"]
    print(
        f"RSS: warm-up end {rss['at_warmup_end_mb']:.1f} MB, max after {rss['max_after_warmup_mb']:.1f} MB, final "
        f"{rss['final_mb']:.1f} MB (growth to max {rss['growth_max_mb']:+.1f}, to final {rss['growth_final_mb']:+.1f})"
    )
    print(f"generator lag behind schedule: p50 {lag['p50']:.2f} ms, p99 {lag['p99']:.2f} ms, max {lag['max']:.1f} ms")
    c = results["criteria"]
    verdict = {True: "PASS", False: "FAIL"}
    print(
        f"{verdict[c['rss_growth']['passed']]} RSS growth after warm-up {c['rss_growth']['value_mb']:+.1f} MB "
        f"(limit < {c['rss_growth']['limit_mb']:g} MB)"
    )
    kinds = f" {results['errors']['by_kind']}" if c["errors"]["value"] else ""
    print(f"{verdict[c['errors']['passed']]} errors other than bad inputs' 4xx: {c['errors']['value']}{kinds}")
    p = c["p99_stable"]
    print(
        f"{verdict[p['passed']]} p99 first {results['latency']['criterion_window_s']:g} s after warm-up "
        f"{p['first_ms']:.2f} ms, last {p['last_ms']:.2f} ms, ratio {p['ratio']:.3f} (limit within {p['limit']:.0%})"
    )


def run(url: str, pid: int, requests: list[Request], args: argparse.Namespace) -> dict[str, Any]:
    """Capacity (unless --rate), then the soak itself; every figure."""
    good = [r for r in requests if r.tag.startswith("good")]
    capacity = None
    rss_before = MemorySampler(pid, time.perf_counter()).sample()["rss_mb"]
    if args.rate is None:
        capacity = asyncio.run(measure_capacity(url, good, args.capacity_s, args.capacity_concurrency))
        rate = args.load * capacity["requests_per_s"]
        print(f"capacity: {capacity['requests_per_s']:.1f} req/s (closed loop, c={args.capacity_concurrency}, "
              f"{args.capacity_s:g} s; outcomes {capacity['outcomes']}); soaking at {args.load:g} x = {rate:.1f} req/s",
              flush=True)  # fmt: skip
        if rate <= 0:
            raise RuntimeError(f"no good request was answered 200 while measuring capacity: {capacity['outcomes']}")
    else:
        rate = args.rate
        print(f"soaking at {rate:g} req/s (--rate)", flush=True)
    print(f"open loop: {args.duration_s:g} s ({args.warmup_s:g} s warm-up), {args.bad_fraction:.0%} bad inputs, "
          f"RSS before {rss_before:.1f} MB", flush=True)  # fmt: skip
    with MemorySampler(pid, time.perf_counter()) as sampler:
        records = asyncio.run(soak_loop(url, requests, args, rate, sampler))
    results = summarise(records, sampler.samples, args)
    report(results)
    return {"capacity": capacity, "rate": rate, "rss_before_load_mb": rss_before, **results}


def _json_safe(value: Any) -> Any:
    """NaN (a percentile of no values) as null, so that soak.json is valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.url is not None and args.server_pid is None:
        print("--url needs --server-pid (the server's top process, whose tree's RSS is measured)", file=sys.stderr)
        return 2
    if not 0 <= args.bad_fraction < 1 or args.warmup_s >= args.duration_s or args.load <= 0:
        print(f"need 0 <= --bad-fraction < 1 (got {args.bad_fraction}), --warmup-s < --duration-s (got "
              f"{args.warmup_s}, {args.duration_s}) and --load > 0 (got {args.load})", file=sys.stderr)  # fmt: skip
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    requests = build_mix(args.model, args.bad_fraction)
    config = {**vars(args), "machine": f"{os.cpu_count()} cores", "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    server: dict[str, Any] = {"started": args.url is None}
    with tempfile.TemporaryDirectory(prefix="vs-soak-") as scratch:
        if args.url is not None:
            results = run(args.url.rstrip("/"), args.server_pid, requests, args)
        else:
            repository = Path(args.repository) if args.repository else None
            if repository is None:
                print("no --repository: training digits and exporting it into a temporary folder", flush=True)
                repository = build_repository(Path(scratch))
            elif not repository.is_dir():
                print(f"--repository {repository}: no such folder", file=sys.stderr)
                return 2
            log = out / "server.log"
            with started_server(repository, args.workers, log) as (url, process):
                print(f"server at {url} (pid {process.pid}); its log: {log}", flush=True)
                results = run(url, process.pid, requests, args)
            server["exit_code"] = process.returncode
            text = log.read_text(errors="replace")
            server["log_lines_warning_or_worse"] = [
                line for line in text.splitlines() if any(w in line for w in ("WARNING", "ERROR", "CRITICAL", "Trace"))
            ][:200]
            print(f"server stopped with SIGTERM: exit code {process.returncode}; "
                  f"{len(server['log_lines_warning_or_worse'])} log lines at WARNING or worse")  # fmt: skip
    results = {"config": config, **results, "server": server}
    (out / "soak.json").write_text(json.dumps(_json_safe(results), indent=1))
    plot(results, out / "soak.png", args.warmup_s)
    print(f"wrote {out / 'soak.json'} and {out / 'soak.png'}")
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
