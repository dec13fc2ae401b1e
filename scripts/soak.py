"""Soak: a long open loop at a share of the server's capacity, good and bad inputs mixed, watching the memory of the
server's process tree; then the aged server against a fresh one.

Criteria (from the reliability issue):
- memory: the RSS of the server's process tree (supervisor, engine, front ends, summed) grows by less than
  ``--max-rss-growth-mb`` from the end of ``--warmup-s`` to its highest point in the soak;
- errors: none but the bad inputs' 4xx, in the soak or in the judgement (a good request answered anything but 200,
  or a bad one answered 5xx, timed out, lost its connection or overflowed the client, is an error);
- latency: after the soak the aged server (still running) and a fresh one (same repository and workers) take turns
  serving good requests in open-loop windows at one rate, the order reversing each round (aged, fresh, fresh, aged,
  ...); the p99 of the aged windows, pooled, is at most ``--max-p99-ratio`` x the fresh windows'. Not the first
  minute's p99 against the last: on a shared machine whose speed moves, that ratio measured the machine
  (docs/performance.md, "Reliability", soak).

Capacity (unless ``--rate``): the load tester's rate search (loadtest/slo.py: double until a step fails, then
bisect) for the highest open-loop rate of good requests, constant arrivals, whose p99 from each scheduled send is
within ``--capacity-p99-ms`` with no error, in steps of ``--capacity-s`` after 1 s not counted. The soak runs at
``--load`` x that rate, the judgement at ``--judge-load`` x it (with ``--rate``: both at that rate).

Writes soak.json (every figure, the RSS series, latency per 10 s, the judgement's windows), soak.png (RSS and
latency over time) and both servers' logs into ``--out``. Exit code 0 when every criterion passes, 1 when one
fails, 2 on a usage error. The full soak, about 14 minutes on the repository ``make serve`` builds::

    .venv/bin/python scripts/soak.py --repository model_repository --out results/soak
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import math
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest.inputs import Payload
from loadtest.openloop import Record, Request, percentile, run_open_loop
from loadtest.pool import WorkerPool
from loadtest.slo import SloSearch, search
from loadtest.step import StepBounds, StepResult, StepSpec, run_step
from service import launcher

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
VERDICT = {True: "PASS", False: "FAIL"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repository", default="model_repository", help="repository both servers load "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--model", default="digits", help="model to send images to (default: %(default)s)")
    p.add_argument("--workers", type=int, default=None, help="front ends per server (default: the server's choice)")
    p.add_argument("--duration-s", type=float, default=600.0, help="open-loop seconds (default: %(default)s)")
    p.add_argument("--warmup-s", type=float, default=60.0, help="first seconds not judged (default: %(default)s)")
    p.add_argument("--load", type=float, default=0.8, help="soak rate as a share of capacity (default: %(default)s)")
    p.add_argument("--rate", type=float, default=None, help="requests/s, skips measuring capacity (default: none)")
    p.add_argument("--capacity-s", type=float, default=5.0, help="counted seconds per capacity step "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--capacity-start-rate", type=float, default=100.0, help="the capacity search's first rate "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--capacity-p99-ms", type=float, default=100.0, help="a capacity step with a higher p99 fails; "
                   "raise it for a slow model (default: %(default)s)")  # fmt: skip
    p.add_argument("--capacity-max-steps", type=int, default=12, help="most capacity steps (default: %(default)s)")
    p.add_argument("--bad-fraction", type=float, default=0.1, help="share of bad inputs (default: %(default)s)")
    p.add_argument("--timeout-s", type=float, default=30.0, help="per-request timeout (default: %(default)s)")
    p.add_argument("--judge-load", type=float, default=0.6, help="judgement rate as a share of capacity "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--judge-rounds", type=int, default=2, help="rounds of one aged and one fresh window "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--judge-window-s", type=float, default=30.0, help="seconds per window (default: %(default)s)")
    p.add_argument("--judge-warmup-s", type=float, default=10.0, help="seconds of load on the fresh server before "
                   "the windows, not counted: its first requests are a cold start (default: %(default)s)")  # fmt: skip
    p.add_argument("--max-rss-growth-mb", type=float, default=50.0, help="memory criterion (default: %(default)s)")
    p.add_argument("--max-p99-ratio", type=float, default=1.2, help="latency criterion: aged p99 / fresh p99 at "
                   "most this (default: %(default)s)")  # fmt: skip
    p.add_argument("--out", default="results/soak", help="output folder (default: %(default)s)")
    return p


def build_mix(model: str, bad_fraction: float, size: int = 1000) -> list[Request]:
    """``size`` requests with the bad ones spread evenly and each kind taken in turn, so any stretch holds the mix."""
    from PIL import Image

    digit3, digit6 = (EXAMPLES / "digit-3.png").read_bytes(), (EXAMPLES / "digit-6.png").read_bytes()
    buf = io.BytesIO()
    with Image.open(io.BytesIO(digit3)) as im:
        im.convert("RGB").resize((64, 64)).save(buf, format="JPEG", quality=90)
    jpeg = buf.getvalue()
    classify, infer = f"/v1/models/{model}/classify", f"/v2/models/{model}/infer"
    png, jpg, js = {"Content-Type": "image/png"}, {"Content-Type": "image/jpeg"}, {"Content-Type": "application/json"}
    v2 = {"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1], "data": [base64.b64encode(digit6).decode()]}]}
    good = [
        Request(classify, digit3, png, "good:png"),
        Request(classify, digit6, png, "good:png"),
        Request(classify, jpeg, jpg, "good:jpeg"),
        Request(infer, json.dumps(v2).encode(), js, "good:v2-json"),
    ]
    bad = [Request(classify, b"\x89PNG\r\n\x1a\n" + random.Random(0).randbytes(2000), png, "bad:corrupt-png"),
           Request(classify, jpeg[: len(jpeg) // 2], jpg, "bad:truncated-jpeg"),
           Request(classify, digit3, {"Content-Type": "text/plain"}, "bad:wrong-content-type"),
           Request(f"/v1/models/{model}-no-such-model/classify", digit6, png, "bad:unknown-model"),
           Request(infer, b'{"inputs": [{"name": "IMAGE", not json', js, "bad:v2-not-json")]  # fmt: skip
    out: list[Request] = []
    taken = Counter[str]()
    for i in range(size):
        kind = "bad" if math.floor((i + 1) * bad_fraction) > math.floor(i * bad_fraction) else "good"
        kinds = bad if kind == "bad" else good
        out.append(kinds[taken[kind] % len(kinds)])
        taken[kind] += 1
    return out


def find_capacity(url: str, good: list[Request], args: argparse.Namespace) -> SloSearch:
    """The highest rate of good requests meeting --capacity-p99-ms with no error: the load tester's search."""
    bodies = [Payload(r.path, r.headers, r.body, 1) for r in good]
    bounds = StepBounds(url=url, warmup_s=1.0, duration_s=args.capacity_s, drain_s=5.0, timeout_s=args.timeout_s,
                        max_requests=10**8)  # fmt: skip
    print(f"capacity: open-loop steps of {args.capacity_s:g} s (+1 s not counted), p99 within "
          f"{args.capacity_p99_ms:g} ms and no error", flush=True)  # fmt: skip
    with WorkerPool(1, bodies) as pool:

        def step(rate: float) -> StepResult:
            result = run_step(pool, StepSpec("open", rate=rate, arrival="constant"), bounds, args.model)
            print(f"  {rate:8.1f} req/s: served {result.requests_per_s:8.1f}/s, p50 {result.latency_ms(50):7.2f} ms, "
                  f"p99 {result.latency_ms(99):7.2f} ms, errors {result.errors or 0}"
                  + (f", client-limited ({'; '.join(result.client_limited)})" if result.client_limited else ""),
                  flush=True)  # fmt: skip
            return result

        return search(step, args.capacity_p99_ms, start_rate=args.capacity_start_rate,
                      max_steps=args.capacity_max_steps)  # fmt: skip


class MemorySampler(threading.Thread):
    """The server tree's RSS once a second, on a thread of its own (the event loop sends the requests)."""

    def __init__(self, pid: int) -> None:
        super().__init__(name="rss-sampler", daemon=True)
        self.pid, self.start_s = pid, time.perf_counter()
        self.samples: list[tuple[float, float]] = []  # (seconds into the soak, MiB)
        self.halt = threading.Event()

    def sample(self) -> None:
        self.samples.append((round(time.perf_counter() - self.start_s, 3), launcher.tree_rss_mb(self.pid)))

    def run(self) -> None:
        while not self.halt.is_set():
            self.sample()
            self.halt.wait(1.0)

    def finish(self) -> list[tuple[float, float]]:
        self.halt.set()
        self.join()
        self.sample()  # the figure at the end of the load
        return self.samples


def soak(
    url: str, requests: list[Request], rate: float, args: argparse.Namespace, memory: MemorySampler
) -> list[Record]:
    counts: Counter[str] = Counter()

    def on_tick(elapsed_s: float) -> None:
        if round(elapsed_s) % 10 == 0:
            rss = memory.samples[-1][1] if memory.samples else math.nan
            print(f"  {elapsed_s:5.0f} s: {dict(counts)}, RSS {rss:7.1f} MiB", flush=True)

    return asyncio.run(run_open_loop(url, requests, rate=rate, duration_s=args.duration_s, timeout_s=args.timeout_s,
                                     on_tick=on_tick, on_record=lambda r: counts.update([r.outcome])))  # fmt: skip


def judge(urls: dict[str, str], good: list[Request], rate: float, args: argparse.Namespace) -> dict[str, Any]:
    """Open-loop windows of good requests at ``rate``, the aged and the fresh server in turn; p99 pooled per server."""

    def window(url: str, seconds: float) -> list[Record]:
        return asyncio.run(run_open_loop(url, good, rate=rate, duration_s=seconds, timeout_s=args.timeout_s))

    if args.judge_warmup_s > 0:
        window(urls["fresh"], args.judge_warmup_s)
    windows: list[dict[str, Any]] = []
    ok_s: dict[str, list[float]] = {"aged": [], "fresh": []}
    for round_ in range(1, args.judge_rounds + 1):
        for server in ("aged", "fresh") if round_ % 2 else ("fresh", "aged"):
            records = window(urls[server], args.judge_window_s)
            ok = [r.latency_s for r in records if r.outcome == "200"]
            ok_s[server] += ok
            windows.append({"server": server, "round": round_, "count": len(records), "ok": len(ok),
                            "p50_ms": percentile(ok, 0.5) * 1000, "p99_ms": percentile(ok, 0.99) * 1000,
                            "outcomes": dict(Counter(r.outcome for r in records))})  # fmt: skip
            print(f"  round {round_}, {server:<5}: {len(records)} requests, {len(ok)} x 200, p50 "
                  f"{windows[-1]['p50_ms']:7.2f} ms, p99 {windows[-1]['p99_ms']:7.2f} ms", flush=True)  # fmt: skip
    p99 = {s: percentile(v, 0.99) * 1000 for s, v in ok_s.items()}
    by_round = {(w["round"], w["server"]): w["p99_ms"] for w in windows}
    per_round = [by_round[k, "aged"] / by_round[k, "fresh"] for k in range(1, args.judge_rounds + 1)]
    return {"rate": rate, "windows": windows, "aged_p99_ms": p99["aged"], "fresh_p99_ms": p99["fresh"],
            "p99_ratio": p99["aged"] / p99["fresh"], "p99_ratio_per_round": per_round}  # fmt: skip


def _is_error(r: Record) -> bool:
    if r.tag.startswith("good"):
        return r.outcome != "200"
    return not (r.outcome.isdigit() and int(r.outcome) < 500)


def summarise(records: list[Record], rss: list[tuple[float, float]], judgement: dict[str, Any],
              args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    by_tag: dict[str, Counter[str]] = {}
    for r in records:
        by_tag.setdefault(r.tag, Counter())[r.outcome] += 1
    errors = Counter(f"{r.tag} {r.outcome}" for r in records if _is_error(r))
    for w in judgement["windows"]:
        errors.update({f"judgement {w['server']} {o}": n for o, n in w["outcomes"].items() if o != "200"})
    good = [r for r in records if r.tag.startswith("good") and r.outcome == "200"]
    per_10s = []
    for start in range(0, math.ceil(args.duration_s), 10):
        values = [r.latency_s for r in good if start <= r.due_s < start + 10]
        per_10s.append({"start_s": start, "count": len(values), "p50_ms": percentile(values, 0.5) * 1000,
                        "p99_ms": percentile(values, 0.99) * 1000})  # fmt: skip
    at_warmup = ([mb for t, mb in rss if t <= args.warmup_s] or [rss[0][1]])[-1]
    growth = max([mb for t, mb in rss if t >= args.warmup_s], default=at_warmup) - at_warmup
    criteria = {
        "rss_growth": {"value_mb": growth, "limit_mb": args.max_rss_growth_mb,
                       "passed": growth < args.max_rss_growth_mb},
        "errors": {"value": sum(errors.values()), "limit": 0, "passed": not errors},
        "p99_aged_vs_fresh": {"value": judgement["p99_ratio"], "limit": args.max_p99_ratio,
                              "passed": judgement["p99_ratio"] <= args.max_p99_ratio},
    }  # fmt: skip
    return {"requests": {"count": len(records), "by_tag": {t: dict(c) for t, c in sorted(by_tag.items())}},
            "errors": dict(errors), "latency_per_10s": per_10s, "rss_mb": {"at_warmup_end": at_warmup,
            "series": rss}, "judgement": judgement, "criteria": criteria,
            "passed": all(c["passed"] for c in criteria.values())}  # fmt: skip


def report(results: dict[str, Any]) -> None:
    print("outcomes per tag:")
    for tag, outcomes in results["requests"]["by_tag"].items():
        print(f"  {tag:<24} " + ", ".join(f"{o}: {n}" for o, n in sorted(outcomes.items())))
    c, j = results["criteria"], results["judgement"]
    print(f"{VERDICT[c['rss_growth']['passed']]} RSS growth after warm-up {c['rss_growth']['value_mb']:+.1f} MiB "
          f"(limit < {c['rss_growth']['limit_mb']:g})")  # fmt: skip
    print(f"{VERDICT[c['errors']['passed']]} errors other than bad inputs' 4xx: {c['errors']['value']}"
          + (f" {results['errors']}" if results["errors"] else ""))  # fmt: skip
    rounds = ", ".join(f"{r:.3f}" for r in j["p99_ratio_per_round"])
    print(f"{VERDICT[c['p99_aged_vs_fresh']['passed']]} p99 aged / fresh {j['p99_ratio']:.3f} (aged "
          f"{j['aged_p99_ms']:.2f} ms, fresh {j['fresh_p99_ms']:.2f} ms at {j['rate']:.1f} req/s; per round "
          f"{rounds}; limit <= {c['p99_aged_vs_fresh']['limit']:g})")  # fmt: skip
    print(f"verdict: {'PASS' if results['passed'] else 'FAIL'}")


def plot(results: dict[str, Any], path: Path, warmup_s: float) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt

    fig, (memory, latency) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    t, mb = zip(*results["rss_mb"]["series"], strict=True)
    memory.plot(t, mb, label="RSS, server process tree")
    limit = results["rss_mb"]["at_warmup_end"] + results["criteria"]["rss_growth"]["limit_mb"]
    memory.axhline(limit, color="red", linestyle=":", label="limit: warm-up end + growth limit")
    memory.set_ylabel("MiB")
    windows = [w for w in results["latency_per_10s"] if w["count"]]
    for q in ("p50", "p99"):
        latency.plot([w["start_s"] + 5 for w in windows], [w[f"{q}_ms"] for w in windows], marker="o", label=q)
    latency.set_yscale("log")
    latency.set_ylabel("latency of good requests per 10 s (ms)")
    latency.set_xlabel(f"seconds into the soak at {results['rate']:.1f} requests/s")
    j = results["judgement"]
    memory.set_title(f"aged p99 / fresh p99 after the soak: {j['p99_ratio']:.2f} at {j['rate']:.1f} requests/s")
    for ax in (memory, latency):
        ax.axvspan(0, warmup_s, color="grey", alpha=0.15, label="warm-up")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _json_safe(value: Any) -> Any:
    """NaN (a percentile of nothing) as null, so soak.json is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problems = [
        *(["--bad-fraction must be in [0, 1)"] if not 0 <= args.bad_fraction < 1 else []),
        *(["--warmup-s must be in [0, --duration-s)"] if not 0 <= args.warmup_s < args.duration_s else []),
        *(["--load, --judge-load, --capacity-s and --judge-window-s must be > 0"]
          if min(args.load, args.judge_load, args.capacity_s, args.judge_window_s) <= 0 else []),
        *(["--judge-rounds must be >= 1"] if args.judge_rounds < 1 else []),
        *([f"{args.repository} holds no model {args.model}"] if not (Path(args.repository) / args.model).is_dir()
          else []),
    ]  # fmt: skip
    if problems:
        print("; ".join(problems), file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    requests = build_mix(args.model, args.bad_fraction)
    good = [r for r in requests if r.tag.startswith("good")]
    results: dict[str, Any] = {"config": vars(args), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    with launcher.start(args.repository, workers=args.workers, log=out / "server.log") as aged:
        print(f"server at {aged.url} (pid {aged.process.pid}); its log: {out / 'server.log'}", flush=True)
        if args.rate is None:
            found = find_capacity(aged.url, good, args)
            results["capacity"] = found.summary()
            if found.best_rate is None:
                print(f"no rate met p99 <= {args.capacity_p99_ms:g} ms with no error", file=sys.stderr)
                return 1
            rate, judge_rate = args.load * found.best_rate, args.judge_load * found.best_rate
            print(f"capacity {found.best_rate:.1f} req/s; soaking at {rate:.1f}", flush=True)
        else:
            rate = judge_rate = args.rate
        results["rate"] = rate
        print(f"soak: {args.duration_s:g} s at {rate:.1f} req/s ({args.warmup_s:g} s warm-up), "
              f"{args.bad_fraction:.0%} bad inputs", flush=True)  # fmt: skip
        memory = MemorySampler(aged.process.pid)
        memory.start()
        records = soak(aged.url, requests, rate, args, memory)
        rss = memory.finish()
        with launcher.start(args.repository, workers=args.workers, log=out / "server-fresh.log") as fresh:
            print(f"judgement: fresh server at {fresh.url}; {args.judge_rounds} round(s) of {args.judge_window_s:g} s "
                  f"windows at {judge_rate:.1f} req/s", flush=True)  # fmt: skip
            judgement = judge({"aged": aged.url, "fresh": fresh.url}, good, judge_rate, args)
        results["exit_codes"] = {"fresh": fresh.stop()}
    results["exit_codes"]["aged"] = aged.stop()
    results.update(summarise(records, rss, judgement, args))
    report(results)
    print(f"servers stopped with SIGTERM: exit codes {results['exit_codes']}")
    (out / "soak.json").write_text(json.dumps(_json_safe(results), indent=1))
    plot(results, out / "soak.png", args.warmup_s)
    print(f"wrote {out / 'soak.json'} and {out / 'soak.png'}")
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
