"""Soak: a long open loop at a fixed share of capacity, good and bad inputs mixed, watching the server's memory; then
the aged server against a fresh one.

Criteria (from the reliability issue):
- memory: the server's RSS (supervisor, engine, front ends and the rest of its process tree, summed) grows by less
  than ``--max-rss-growth-mb`` (50) from the end of ``--warmup-s`` to its highest point in the soak;
- errors: none apart from the bad inputs' 4xx, in the soak or in the judgement windows (a good request answered
  anything but 200, or a bad one answered 5xx, timed out, lost its connection or overflowed the client, is an error);
- latency: after the soak the aged server (still running) and a fresh one (same repository, same settings, another
  port) take turns serving good requests in open-loop windows at the same rate; the p99 of the aged windows, pooled,
  is at most ``--max-p99-ratio`` (1.2) x the fresh windows'. Each round reverses the order (aged, fresh, fresh,
  aged, ...), so that a steady change of the machine's speed falls on both alike.

Why not the first minute's p99 against the last (the criterion before): on a shared machine whose speed moves, that
ratio measured the machine. A soak's p99 went 29 -> 68 ms (x2.35), yet a server driven past its capacity for 8
minutes and a fresh one, interleaved at the same 60% load, gave p99 18.4 / 11.5 ms aged and 21.8 / 15.4 ms fresh.
The first and last minute are still printed, as information.

Capacity (unless ``--rate``): the highest rate the soak's own open loop (``loadtest/openloop.py``: a constant
schedule, no coordinated omission) sustains with good requests, in steps of ``--capacity-s`` (1 s more not counted):
doubled from ``--capacity-start-rate`` while sustained, halved while not, then bisected to within 10%. A step is
sustained when every request got 200 (no client overflow, no 503), the 200s answered within the counted seconds
came to at least 97% of the offered rate, and the p99 from each request's scheduled send (so a lagging generator
counts too) is under ``--capacity-max-p99-ms``. Each step runs once (a rerun would let a lucky step count). Before, a
closed loop of 16 clients set the capacity, and 80% of its figure was past what an open loop sustains on these cores
(the load tester counted 37,730 client overflows there): a closed loop waits for answers, an open loop does not.

Steps: start a server on free ports (or use ``--url`` and ``--server-pid``), measure its capacity, run the open loop
at ``--load`` x that capacity for ``--duration-s`` while a thread reads the server tree's RSS from /proc once a
second (a progress line every 10 s), then start the fresh server and run the judgement windows (at ``--judge-load``
x capacity). An external server (``--url``) is judged against a fresh one only with ``--repository`` (started with
``--workers``; the script cannot check that these match the external server's); without it the latency criterion
is "not judged". Writes ``soak.json`` (every figure, the RSS series, latency per minute and per 10 s, the
judgement windows), ``soak.png`` (RSS and latency over time, the judgement windows) and, for the servers it started,
``server.log`` and ``server-fresh.log`` into ``--out``. Exit code 0 when every criterion passes, 1 when one fails,
3 when none failed but one was not judged.

The full soak (about 14 minutes: capacity, 10 minutes at 80% of it, the judgement; trains and exports digits first
when no ``--repository``)::

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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.openloop import Record, Request, percentile, run_open_loop

ROOT = Path(__file__).resolve().parent.parent

KB_PER_MB = 1024
ROLES = {
    "service.frontend.server": "frontend",
    "service.engine.process": "engine",
    "service.transport.janitor": "janitor",
    "multiprocessing.resource_tracker": "resource-tracker",
}
CAPACITY_SETTLE_S = 1.0  # each capacity step's first second is not counted: connections opening, batches forming
CAPACITY_MIN_SERVED = 0.97  # 200s per second over the offered rate for a step to count as sustained
CAPACITY_RESOLUTION = 1.1  # bisect until the lowest rate not sustained is within 10% of the highest sustained
CAPACITY_RATE_LIMITS = (1.0, 100_000.0)  # the search gives up outside these (requests/s)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running server to soak (default: start one on --repository)")
    p.add_argument("--server-pid", type=int, default=None, help="with --url: the server's top process, for RSS "
                   "(default: none; required with --url)")  # fmt: skip
    p.add_argument("--repository", default=None, help="start a server on this repository; with --url, the fresh "
                   "server's only (default: train digits and export it into a temporary folder, about 30 s; with "
                   "--url, none: the latency criterion is not judged)")  # fmt: skip
    p.add_argument("--model", default="digits", help="model to send images to (default: %(default)s)")
    p.add_argument("--workers", type=int, default=0, help="front ends of a started server; 0: the server's own "
                   "choice (default: %(default)s)")  # fmt: skip
    p.add_argument("--duration-s", type=float, default=600.0, help="open-loop seconds (default: %(default)s)")
    p.add_argument("--warmup-s", type=float, default=60.0, help="first seconds not judged (default: %(default)s)")
    p.add_argument("--load", type=float, default=0.8, help="share of the open-loop capacity to soak at "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--rate", type=float, default=None, help="requests/s, skips measuring capacity (default: none)")
    p.add_argument("--capacity-s", type=float, default=5.0, help="counted seconds of each open-loop step measuring "
                   "capacity, after 1 s not counted (default: %(default)s)")  # fmt: skip
    p.add_argument("--capacity-start-rate", type=float, default=100.0, help="requests/s of the capacity search's "
                   "first step (default: %(default)s)")  # fmt: skip
    p.add_argument("--capacity-max-p99-ms", type=float, default=100.0, help="a capacity step with a higher p99 is not "
                   "sustained; raise it for a slow model (default: %(default)s)")  # fmt: skip
    p.add_argument("--bad-fraction", type=float, default=0.1, help="share of bad inputs (default: %(default)s)")
    p.add_argument("--timeout-s", type=float, default=30.0, help="per-request timeout (default: %(default)s)")
    p.add_argument("--judge-load", type=float, default=0.6, help="judgement windows' rate as a share of the "
                   "open-loop capacity (default: %(default)s)")  # fmt: skip
    p.add_argument("--judge-rate", type=float, default=None, help="judgement windows' requests/s (default: "
                   "--judge-load x capacity, or the soak's --rate when capacity was not measured)")  # fmt: skip
    p.add_argument("--judge-rounds", type=int, default=2, help="rounds of one aged and one fresh window "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--judge-window-s", type=float, default=30.0, help="seconds per judgement window "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--judge-warmup-s", type=float, default=10.0, help="seconds of load on the fresh server before "
                   "the windows, not counted: its first requests are a cold start, not youth "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--max-rss-growth-mb", type=float, default=50.0, help="memory criterion (default: %(default)s)")
    p.add_argument("--max-p99-ratio", type=float, default=1.2, help="latency criterion: aged p99 / fresh p99 at most "
                   "this (default: %(default)s)")  # fmt: skip
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


def server_log_summary(log: Path, process: subprocess.Popen[bytes]) -> dict[str, Any]:
    """A stopped server's exit code and its log lines at WARNING or worse (the first 200)."""
    text = log.read_text(errors="replace")
    warnings = [line for line in text.splitlines() if any(w in line for w in ("WARNING", "ERROR", "CRITICAL", "Trace"))]
    return {"exit_code": process.returncode, "log_lines_warning_or_worse": warnings[:200]}


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


# ---- capacity -----------------------------------------------------------------------------------------------------


def capacity_step(records: list[Record], rate: float, counted_s: float, max_p99_ms: float) -> dict[str, Any]:
    """One open-loop step of the capacity search, judged on the requests due after the first ``CAPACITY_SETTLE_S``."""
    counted = [r for r in records if r.due_s >= CAPACITY_SETTLE_S]
    outcomes = Counter(r.outcome for r in counted)
    # Answers that came back within the counted seconds: a server that falls behind answers fewer than were offered
    # there, whereas counting the requests due there would wait for their late answers and see none missing.
    end_s = CAPACITY_SETTLE_S + counted_s
    served = sum(1 for r in records if r.outcome == "200" and CAPACITY_SETTLE_S <= r.done_s < end_s) / counted_s
    ok = [r.latency_s for r in counted if r.outcome == "200"]
    p99 = percentile(ok, 0.99) * 1000
    why_not = []
    if set(outcomes) - {"200"}:
        why_not.append("outcomes " + ", ".join(f"{o}: {n}" for o, n in sorted(outcomes.items())))
    if served < CAPACITY_MIN_SERVED * rate:
        why_not.append(f"served {served:.1f}/s < {CAPACITY_MIN_SERVED:.0%} of offered")
    if not p99 <= max_p99_ms:
        why_not.append(f"p99 {p99:.1f} ms > {max_p99_ms:g} ms")
    return {"rate": rate, "served_per_s": served, "p50_ms": percentile(ok, 0.5) * 1000, "p99_ms": p99,
            "lag_p99_ms": percentile([r.sent_s - r.due_s for r in counted], 0.99) * 1000,
            "outcomes": dict(outcomes), "sustained": not why_not, "why_not": "; ".join(why_not)}  # fmt: skip


def find_capacity(try_rate: Callable[[float], dict[str, Any]], start_rate: float) -> dict[str, Any]:
    """The highest rate ``try_rate`` reports sustained: doubled from ``start_rate`` while sustained, halved while
    not, then bisected (geometrically) until the lowest rate not sustained is within ``CAPACITY_RESOLUTION`` of it.
    ``requests_per_s`` is 0 when nothing down to the lowest limit was sustained."""
    steps: list[dict[str, Any]] = []

    # Each rate is tried once. Running a failed step again until it passed would let one lucky step on a noisy
    # machine set the capacity (measured here: 672.7 and 733.6 requests/s each failed, then passed), and overstating
    # the capacity is what this search replaces; a failure from a neighbour's burst understates it, the safe side.
    def sustains(rate: float) -> bool:
        steps.append(try_rate(rate))
        return bool(steps[-1]["sustained"])

    low, high = 0.0, math.inf
    rate = start_rate
    while True:
        if sustains(rate):
            low = rate
        else:
            high = rate
        if high == math.inf:
            rate = 2 * low
        elif low == 0:
            rate = high / 2
        elif high / low > CAPACITY_RESOLUTION:
            rate = math.sqrt(low * high)
        else:
            break
        if not CAPACITY_RATE_LIMITS[0] <= rate <= CAPACITY_RATE_LIMITS[1]:
            break
    return {"requests_per_s": low, "lowest_not_sustained": high if high != math.inf else None, "steps": steps}


def measure_capacity(url: str, good: list[Request], args: argparse.Namespace) -> dict[str, Any]:
    """The open-loop capacity for good requests (see the module's docstring), a line printed per step."""

    def try_rate(rate: float) -> dict[str, Any]:
        records = asyncio.run(run_open_loop(url, good, rate=rate, duration_s=CAPACITY_SETTLE_S + args.capacity_s,
                                            timeout_s=args.timeout_s))  # fmt: skip
        step = capacity_step(records, rate, args.capacity_s, args.capacity_max_p99_ms)
        print(f"  {rate:8.1f} req/s: served {step['served_per_s']:8.1f}/s, p50 {step['p50_ms']:7.2f} ms, p99 "
              f"{step['p99_ms']:7.2f} ms, send lag p99 {step['lag_p99_ms']:6.2f} ms: "
              + ("sustained" if step["sustained"] else f"not sustained ({step['why_not']})"), flush=True)  # fmt: skip
        time.sleep(0.5)  # the server's queues empty between steps
        return step

    print(f"capacity: open loop of good requests, {args.capacity_s:g} s steps (+{CAPACITY_SETTLE_S:g} s not counted)",
          flush=True)  # fmt: skip
    return {"method": "open loop, good requests, highest rate sustained", "step_s": args.capacity_s,
            "max_p99_ms": args.capacity_max_p99_ms, "min_served_share": CAPACITY_MIN_SERVED,
            **find_capacity(try_rate, args.capacity_start_rate)}  # fmt: skip


# ---- the soak -----------------------------------------------------------------------------------------------------


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


# ---- the judgement: aged against fresh ----------------------------------------------------------------------------


def judge_windows(urls: dict[str, str], good: list[Request], rate: float, args: argparse.Namespace) -> dict[str, Any]:
    """Open-loop windows of good requests at ``rate``, the aged and the fresh server in turn; p99 pooled per server."""
    if args.judge_warmup_s > 0:
        asyncio.run(run_open_loop(urls["fresh"], good, rate=rate, duration_s=args.judge_warmup_s,
                                  timeout_s=args.timeout_s))  # fmt: skip
    windows: list[dict[str, Any]] = []
    ok_s: dict[str, list[float]] = {"aged": [], "fresh": []}
    for round_ in range(1, args.judge_rounds + 1):
        for server in ("aged", "fresh") if round_ % 2 else ("fresh", "aged"):
            records = asyncio.run(run_open_loop(urls[server], good, rate=rate, duration_s=args.judge_window_s,
                                                timeout_s=args.timeout_s))  # fmt: skip
            ok = [r.latency_s for r in records if r.outcome == "200"]
            ok_s[server] += ok
            window = {"server": server, "round": round_, "count": len(records), "ok": len(ok),
                      "p50_ms": percentile(ok, 0.5) * 1000, "p99_ms": percentile(ok, 0.99) * 1000,
                      "lag_p99_ms": percentile([r.sent_s - r.due_s for r in records], 0.99) * 1000,
                      "outcomes": dict(Counter(r.outcome for r in records))}  # fmt: skip
            windows.append(window)
            print(f"  round {round_}, {server:<5}: {len(records)} requests, {len(ok)} x 200, p50 "
                  f"{window['p50_ms']:7.2f} ms, p99 {window['p99_ms']:7.2f} ms", flush=True)  # fmt: skip
    pooled = {s: {"count": len(v), "p50_ms": percentile(v, 0.5) * 1000, "p99_ms": percentile(v, 0.99) * 1000}
              for s, v in ok_s.items()}  # fmt: skip
    per_round = []
    for round_ in range(1, args.judge_rounds + 1):
        p99 = {w["server"]: w["p99_ms"] for w in windows if w["round"] == round_}
        per_round.append(p99["aged"] / p99["fresh"] if p99["fresh"] > 0 else float("nan"))
    ratio = pooled["aged"]["p99_ms"] / pooled["fresh"]["p99_ms"] if pooled["fresh"]["p99_ms"] > 0 else float("nan")
    # Rounds on both sides of the limit: the machine's noise is larger than the margin (one stall in one window sets
    # a p99), so the verdict says little; more or longer rounds, or a quieter machine, would.
    agree = len({r <= args.max_p99_ratio for r in per_round}) == 1
    return {"judged": True, "rate": rate, "window_s": args.judge_window_s, "rounds": args.judge_rounds,
            "fresh_warmup_s": args.judge_warmup_s, "windows": windows, "aged": pooled["aged"],
            "fresh": pooled["fresh"], "p99_ratio": ratio, "p99_ratio_per_round": per_round,
            "rounds_agree": agree,
            "ratio_of": "pooled: p99 of every aged window's 200s over p99 of every fresh window's",
            "errors": sum(w["count"] - w["ok"] for w in windows)}  # fmt: skip


def judge_against_fresh(
    url: str, good: list[Request], rate: float, repository: Path | None, args: argparse.Namespace, out: Path
) -> dict[str, Any]:
    """Start a fresh server like the aged one and run the judgement windows, or say why it cannot be done."""
    if repository is None:
        reason = ("an external server (--url) and no --repository: nothing to start a fresh server from; pass the "
                  "repository (and --workers) the external server runs")  # fmt: skip
        print(f"judgement: not judged: {reason}", flush=True)
        return {"judged": False, "reason": reason}
    log = out / "server-fresh.log"
    with started_server(repository, args.workers, log) as (fresh_url, process):
        print(f"judgement: fresh server at {fresh_url} (pid {process.pid}); {args.judge_warmup_s:g} s warm-up, then "
              f"{args.judge_rounds} round(s) of {args.judge_window_s:g} s windows at {rate:.1f} req/s, good requests "
              "only", flush=True)  # fmt: skip
        judgement = judge_windows({"aged": url, "fresh": fresh_url}, good, rate, args)
    judgement["fresh_server"] = {"url": fresh_url, **server_log_summary(log, process)}
    return judgement


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


def summarise(
    records: list[Record], samples: list[dict[str, Any]], judgement: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    by_tag: dict[str, Counter[str]] = {}
    for r in records:
        by_tag.setdefault(r.tag, Counter())[r.outcome] += 1
    errors = Counter(f"{r.tag} {r.outcome}" for r in records if _is_error(r))
    for w in judgement.get("windows", []):
        for outcome, n in w["outcomes"].items():
            if outcome != "200":
                errors[f"judgement {w['server']} good {outcome}"] += n
    good_ok = [r for r in records if r.tag.startswith("good") and r.outcome == "200"]
    # First and last minute after the warm-up (shorter for a short run, so that the two never overlap): information
    # only, since on a machine whose speed moves their ratio measures the machine as much as the server.
    window_s = min(60.0, (args.duration_s - args.warmup_s) / 2)
    first = [r.latency_s for r in good_ok if args.warmup_s <= r.due_s < args.warmup_s + window_s]
    last = [r.latency_s for r in good_ok if args.duration_s - window_s <= r.due_s]
    p99_first, p99_last = percentile(first, 0.99) * 1000, percentile(last, 0.99) * 1000

    judged = [s for s in samples if s["t_s"] >= args.warmup_s]
    before = [s for s in samples if s["t_s"] <= args.warmup_s]
    at_warmup = (before[-1] if before else judged[0])["rss_mb"] if samples else float("nan")
    rss_max = max(s["rss_mb"] for s in judged) if judged else float("nan")
    rss_final = samples[-1]["rss_mb"] if samples else float("nan")
    growth = rss_max - at_warmup
    lag = [r.sent_s - r.due_s for r in records]

    if judgement["judged"]:
        ratio = judgement["p99_ratio"]
        latency = {"aged_p99_ms": judgement["aged"]["p99_ms"], "fresh_p99_ms": judgement["fresh"]["p99_ms"],
                   "ratio": ratio, "limit": args.max_p99_ratio, "passed": ratio <= args.max_p99_ratio}  # fmt: skip
    else:
        latency = {"limit": args.max_p99_ratio, "reason": judgement["reason"], "passed": None}
    criteria = {
        "rss_growth": {"value_mb": growth, "limit_mb": args.max_rss_growth_mb,
                       "passed": growth < args.max_rss_growth_mb},
        "errors": {"value": sum(errors.values()), "limit": 0, "passed": not errors},
        "p99_vs_fresh": latency,
    }  # fmt: skip
    outcomes = [c["passed"] for c in criteria.values()]
    verdict = "fail" if False in outcomes else "not judged" if None in outcomes else "pass"
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
            "first_vs_last": {
                "window_s": window_s,
                "first_p99_ms": p99_first,
                "last_p99_ms": p99_last,
                "ratio": p99_last / p99_first if first and last else float("nan"),
                "judged": False,
            },
        },
        "rss": {
            "at_warmup_end_mb": at_warmup,
            "max_after_warmup_mb": rss_max,
            "final_mb": rss_final,
            "growth_max_mb": growth,
            "growth_final_mb": rss_final - at_warmup,
            "series": samples,
        },
        "judgement": judgement,
        "criteria": criteria,
        "verdict": verdict,
        "passed": verdict == "pass",
    }


def plot(results: dict[str, Any], path: Path, warmup_s: float) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt

    samples, rss = results["rss"]["series"], results["rss"]
    fig = plt.figure(figsize=(10, 10))
    grid = fig.add_gridspec(3, 1, height_ratios=[3, 3, 2])
    top = fig.add_subplot(grid[0])
    middle = fig.add_subplot(grid[1], sharex=top)
    bottom = fig.add_subplot(grid[2])
    t = [s["t_s"] for s in samples]
    # Change since the first sample, absolute figures in the labels: on one absolute scale a 1.4 GB tree flattens
    # every line, and growth is what the soak is after.
    # PSS stays out of the plot (it is in soak.json): it falls whenever another process on the machine maps the
    # same libraries, so on a shared machine it moves with the neighbours, not with the server.
    lines = {"RSS, whole tree": [s["rss_mb"] for s in samples]}
    for role in sorted({r for s in samples for r in s["rss_mb_by_role"]}):
        lines[f"RSS, {role}"] = [s["rss_mb_by_role"].get(role, 0.0) for s in samples]
    for i, (name, values) in enumerate(lines.items()):
        style: dict[str, Any] = {"linewidth": 2.0} if i == 0 else {"linewidth": 1.0, "alpha": 0.8}
        top.plot(t, [v - values[0] for v in values], label=f"{name} ({values[0]:.0f} MB at start)", **style)
    limit = rss["at_warmup_end_mb"] - samples[0]["rss_mb"] + results["criteria"]["rss_growth"]["limit_mb"]
    top.axhline(limit, color="red", linestyle=":", linewidth=1, label="limit: warm-up end + growth limit")
    top.set_ylabel("memory change since start (MB)")
    top.set_title(f"server memory; RSS growth after warm-up {rss['growth_max_mb']:+.1f} MB")
    windows = [w for w in results["latency"]["per_10s"] if w["count"]]
    x = [w["start_s"] + 5 for w in windows]
    middle.plot(x, [w["p50_ms"] for w in windows], marker="o", markersize=3, label="p50")
    middle.plot(x, [w["p99_ms"] for w in windows], marker="o", markersize=3, label="p99")
    middle.set_yscale("log")
    middle.set_ylabel("latency of good requests (ms, log)")
    middle.set_xlabel("seconds into the open loop")
    middle.set_title(f"soak at {results['rate']:.1f} requests/s: latency per 10 s window")
    for ax in (top, middle):
        ax.axvspan(0, warmup_s, color="grey", alpha=0.15, label="warm-up")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    judgement = results["judgement"]
    if judgement["judged"]:
        jw = judgement["windows"]
        colours = {"aged": "tab:red", "fresh": "tab:blue"}
        positions = range(len(jw))
        bottom.bar(positions, [w["p99_ms"] for w in jw], color=[colours[w["server"]] for w in jw], alpha=0.6,
                   label="p99 (bar)")  # fmt: skip
        bottom.scatter(positions, [w["p50_ms"] for w in jw], color="black", marker="_", s=200, label="p50")
        bottom.set_xticks(list(positions), [f"{w['server']}\nround {w['round']}" for w in jw], fontsize=8)
        bottom.set_ylabel("latency (ms)")
        limit = results["criteria"]["p99_vs_fresh"]["limit"]
        bottom.set_title(f"after the soak, in turns at {judgement['rate']:.1f} requests/s: aged p99 / fresh p99 "
                         f"{judgement['p99_ratio']:.2f} (pooled; limit {limit:g})", fontsize=10)  # fmt: skip
        bottom.grid(True, axis="y", alpha=0.3)
        bottom.legend(fontsize=7, loc="best")
    else:
        bottom.axis("off")
        bottom.text(0.5, 0.5, f"aged against fresh: not judged\n({judgement['reason']})", ha="center", va="center",
                    wrap=True, fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


VERDICT = {True: "PASS", False: "FAIL", None: "NOT JUDGED"}


def report(results: dict[str, Any]) -> None:
    print("\noutcomes per tag:")
    for tag, outcomes in results["requests"]["by_tag"].items():
        print(f"  {tag:<24} " + ", ".join(f"{o}: {n}" for o, n in sorted(outcomes.items())))
    print("latency of good requests per minute (ms):")
    for i, w in enumerate(results["latency"]["per_minute"]):
        print(f"  minute {i + 1:>2}: {w['count']:>7} requests, p50 {w['p50_ms']:8.2f}, p99 {w['p99_ms']:8.2f}")
    fl = results["latency"]["first_vs_last"]
    print(f"  (information, not a criterion: p99 of the first {fl['window_s']:g} s after warm-up "
          f"{fl['first_p99_ms']:.2f} ms, of the last {fl['last_p99_ms']:.2f} ms, ratio {fl['ratio']:.3f})")  # fmt: skip
    rss, lag = results["rss"], results["client_lag_ms"]
    print(
        f"RSS: warm-up end {rss['at_warmup_end_mb']:.1f} MB, max after {rss['max_after_warmup_mb']:.1f} MB, final "
        f"{rss['final_mb']:.1f} MB (growth to max {rss['growth_max_mb']:+.1f}, to final {rss['growth_final_mb']:+.1f})"
    )
    print(f"generator lag behind schedule: p50 {lag['p50']:.2f} ms, p99 {lag['p99']:.2f} ms, max {lag['max']:.1f} ms")
    c = results["criteria"]
    print(
        f"{VERDICT[c['rss_growth']['passed']]} RSS growth after warm-up {c['rss_growth']['value_mb']:+.1f} MB "
        f"(limit < {c['rss_growth']['limit_mb']:g} MB)"
    )
    kinds = f" {results['errors']['by_kind']}" if c["errors"]["value"] else ""
    print(f"{VERDICT[c['errors']['passed']]} errors other than bad inputs' 4xx: {c['errors']['value']}{kinds}")
    p, j = c["p99_vs_fresh"], results["judgement"]
    if p["passed"] is None:
        print(f"NOT JUDGED p99 of the aged server against a fresh one: {p['reason']}")
    else:
        rounds = ", ".join(f"{r:.3f}" for r in j["p99_ratio_per_round"])
        print(f"{VERDICT[p['passed']]} p99 aged / fresh {p['ratio']:.3f} (aged {p['aged_p99_ms']:.2f} ms, fresh "
              f"{p['fresh_p99_ms']:.2f} ms; pooled over {j['rounds']} round(s) of {j['window_s']:g} s at "
              f"{j['rate']:.1f} req/s; per round {rounds}; limit <= {p['limit']:g})")  # fmt: skip
        if not j["rounds_agree"]:
            print("  the rounds fall on both sides of the limit: the machine's noise is larger than the margin, so "
                  "this verdict says little (more or longer rounds, or a quieter machine)")  # fmt: skip
    print(f"verdict: {results['verdict'].upper()}")


def run(
    url: str, pid: int, requests: list[Request], args: argparse.Namespace, repository: Path | None, out: Path
) -> dict[str, Any]:
    """Capacity (unless --rate), the soak, then the aged server against a fresh one; every figure."""
    good = [r for r in requests if r.tag.startswith("good")]
    capacity = None
    rss_before = MemorySampler(pid, time.perf_counter()).sample()["rss_mb"]
    if args.rate is None:
        capacity = measure_capacity(url, good, args)
        if capacity["requests_per_s"] <= 0:
            raise RuntimeError(f"no open-loop rate down to {CAPACITY_RATE_LIMITS[0]:g} req/s was sustained: "
                               f"{capacity['steps'][-1]['why_not']}")  # fmt: skip
        rate = args.load * capacity["requests_per_s"]
        high = capacity["lowest_not_sustained"]
        print(f"capacity: {capacity['requests_per_s']:.1f} req/s sustained"
              + (f", {high:.1f} not" if high is not None else "")
              + f"; soaking at {args.load:g} x = {rate:.1f} req/s", flush=True)  # fmt: skip
    else:
        rate = args.rate
        print(f"soaking at {rate:g} req/s (--rate)", flush=True)
    if args.judge_rate is not None:
        judge_rate, judge_rate_from = args.judge_rate, "--judge-rate"
    elif capacity is not None:
        judge_rate, judge_rate_from = args.judge_load * capacity["requests_per_s"], f"{args.judge_load:g} x capacity"
    else:
        judge_rate, judge_rate_from = rate, "the soak's --rate (capacity not measured)"
    print(f"open loop: {args.duration_s:g} s ({args.warmup_s:g} s warm-up), {args.bad_fraction:.0%} bad inputs, "
          f"RSS before {rss_before:.1f} MB", flush=True)  # fmt: skip
    with MemorySampler(pid, time.perf_counter()) as sampler:
        records = asyncio.run(soak_loop(url, requests, args, rate, sampler))
    judgement = {"rate_from": judge_rate_from, **judge_against_fresh(url, good, judge_rate, repository, args, out)}
    results = summarise(records, sampler.samples, judgement, args)
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
    if not 0 <= args.bad_fraction < 1 or args.warmup_s >= args.duration_s or args.load <= 0 or args.judge_load <= 0:
        print(f"need 0 <= --bad-fraction < 1 (got {args.bad_fraction}), --warmup-s < --duration-s (got "
              f"{args.warmup_s}, {args.duration_s}), --load > 0 (got {args.load}) and --judge-load > 0 (got "
              f"{args.judge_load})", file=sys.stderr)  # fmt: skip
        return 2
    if args.judge_rounds < 1 or args.judge_window_s <= 0 or args.judge_warmup_s < 0 or args.capacity_s <= 0:
        print(f"need --judge-rounds >= 1 (got {args.judge_rounds}), --judge-window-s > 0 (got {args.judge_window_s}), "
              f"--judge-warmup-s >= 0 (got {args.judge_warmup_s}) and --capacity-s > 0 (got {args.capacity_s})",
              file=sys.stderr)  # fmt: skip
        return 2
    repository = Path(args.repository) if args.repository else None
    if repository is not None and not repository.is_dir():
        print(f"--repository {repository}: no such folder", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    requests = build_mix(args.model, args.bad_fraction)
    config = {**vars(args), "machine": f"{os.cpu_count()} cores", "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    server: dict[str, Any] = {"started": args.url is None}
    with tempfile.TemporaryDirectory(prefix="vs-soak-") as scratch:
        if args.url is not None:
            results = run(args.url.rstrip("/"), args.server_pid, requests, args, repository, out)
        else:
            if repository is None:
                print("no --repository: training digits and exporting it into a temporary folder", flush=True)
                repository = build_repository(Path(scratch))
            log = out / "server.log"
            with started_server(repository, args.workers, log) as (url, process):
                print(f"server at {url} (pid {process.pid}); its log: {log}", flush=True)
                results = run(url, process.pid, requests, args, repository, out)
            server.update(server_log_summary(log, process))
            print(f"server stopped with SIGTERM: exit code {process.returncode}; "
                  f"{len(server['log_lines_warning_or_worse'])} log lines at WARNING or worse")  # fmt: skip
    results = {"config": config, **results, "server": server}
    (out / "soak.json").write_text(json.dumps(_json_safe(results), indent=1))
    plot(results, out / "soak.png", args.warmup_s)
    print(f"wrote {out / 'soak.json'} and {out / 'soak.png'}")
    return {"pass": 0, "fail": 1, "not judged": 3}[results["verdict"]]


if __name__ == "__main__":
    sys.exit(main())
