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

    visionserve bench soak --repository model_repository --out results/soak
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import math
import random
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from loadtest.inputs import Payload
from loadtest.openloop import Record, Request
from service import launcher
from service.bench import kit

FLAGS: list[kit.Flag] = [
    ("--repository", "model_repository", "repository both servers load"),
    ("--model", "digits", "model to send images to"),
    ("--workers", None, "front ends per server (default: the server's choice)", int),
    ("--duration-s", 600.0, "open-loop seconds"),
    ("--warmup-s", 60.0, "first seconds not judged"),
    ("--load", 0.8, "soak rate as a share of capacity", kit.POSITIVE),
    ("--rate", None, "requests/s, skips measuring capacity (default: none)", kit.POSITIVE),
    ("--capacity-s", 5.0, "counted seconds per capacity step", kit.POSITIVE),
    ("--capacity-start-rate", 100.0, "the capacity search's first rate", kit.POSITIVE),
    ("--capacity-p99-ms", 100.0, "a capacity step with a higher p99 fails; raise it for a slow model"),
    ("--capacity-max-steps", 12, "most capacity steps", kit.COUNT),
    ("--bad-fraction", 0.1, "share of bad inputs, in [0, 1)"),
    ("--timeout-s", 30.0, "per-request timeout"),
    ("--judge-load", 0.6, "judgement rate as a share of capacity", kit.POSITIVE),
    ("--judge-rounds", 2, "rounds of one aged and one fresh window", kit.COUNT),
    ("--judge-window-s", 30.0, "seconds per window", kit.POSITIVE),
    ("--judge-warmup-s", 10.0, "seconds on the fresh server before the windows, not counted: a cold start"),
    ("--max-rss-growth-mb", 50.0, "memory criterion"),
    ("--max-p99-ratio", 1.2, "latency criterion: aged p99 / fresh p99 at most this"),
    ("--out", "results/soak", "output folder"),
]


def build_mix(model: str, bad_fraction: float, size: int = 1000) -> list[Request]:
    """``size`` requests with the bad ones spread evenly and each kind taken in turn, so any stretch holds the mix."""
    from PIL import Image

    digit3, digit6 = (kit.EXAMPLES / "digit-3.png").read_bytes(), (kit.EXAMPLES / "digit-6.png").read_bytes()
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
    bad = [
        Request(classify, b"\x89PNG\r\n\x1a\n" + random.Random(0).randbytes(2000), png, "bad:corrupt-png"),
        Request(classify, jpeg[: len(jpeg) // 2], jpg, "bad:truncated-jpeg"),
        Request(classify, digit3, {"Content-Type": "text/plain"}, "bad:wrong-content-type"),
        Request(f"/v1/models/{model}-no-such-model/classify", digit6, png, "bad:unknown-model"),
        Request(infer, b'{"inputs": [{"name": "IMAGE", not json', js, "bad:v2-not-json"),
    ]

    def pick(i: int) -> Request:  # i * bad_fraction, rounded down: the bad ones before i
        before = math.floor(i * bad_fraction)
        return bad[before % len(bad)] if math.floor((i + 1) * bad_fraction) > before else good[(i - before) % len(good)]

    return [pick(i) for i in range(size)]


def soak(
    url: str, requests: list[Request], rate: float, args: argparse.Namespace, memory: kit.Sampler[float]
) -> list[Record]:
    counts: Counter[str] = Counter()

    def on_tick(elapsed_s: float) -> None:
        if round(elapsed_s) % 10 == 0:
            print(f"  {elapsed_s:5.0f} s: {dict(counts)}, RSS {memory.latest(math.nan):7.1f} MiB")

    more = {"timeout_s": args.timeout_s, "on_tick": on_tick, "on_record": lambda r: counts.update([r.outcome])}
    return kit.open_loop(url, requests, rate, args.duration_s, **more)


def judge(urls: dict[str, str], good: list[Request], rate: float, args: argparse.Namespace) -> dict[str, Any]:
    """Open-loop windows of good requests at ``rate``, the aged and the fresh server in turn; p99 pooled per server."""

    def window(url: str, seconds: float) -> list[Record]:
        return kit.open_loop(url, good, rate, seconds, timeout_s=args.timeout_s)

    def measure(server: str, round_: int) -> tuple[dict[str, Any], list[float]]:
        records = window(urls[server], args.judge_window_s)
        w = kit.latency(records)
        print(f"  round {round_}, {server:<5}: {w['count']} requests, {w['ok']} x 200, p50 {w['p50_ms']:7.2f} ms, p99 "
              f"{w['p99_ms']:7.2f} ms")  # fmt: skip
        return w, kit.ok_seconds(records)

    if args.judge_warmup_s > 0:
        window(urls["fresh"], args.judge_warmup_s)
    windows, ok_s = kit.take_turns(("aged", "fresh"), args.judge_rounds, measure, key="server")
    p99 = {s: kit.ms(v, 0.99) for s, v in ok_s.items()}
    by_round = {(w["round"], w["server"]): w["p99_ms"] for w in windows}
    per_round = [by_round[k, "aged"] / by_round[k, "fresh"] for k in range(1, args.judge_rounds + 1)]
    figures = {"rate": rate, "windows": windows, "aged_p99_ms": p99["aged"], "fresh_p99_ms": p99["fresh"]}
    return figures | {"p99_ratio": p99["aged"] / p99["fresh"], "p99_ratio_per_round": per_round}


def _is_error(r: Record) -> bool:
    if r.tag.startswith("good"):
        return r.outcome != "200"
    return not (r.outcome.isdigit() and int(r.outcome) < 500)


def summarise(
    records: list[Record], rss: list[tuple[float, float]], judgement: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
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
        per_10s.append({"start_s": start, "count": len(values), **kit.quantiles(values)})
    at_warmup = ([mb for t, mb in rss if t <= args.warmup_s] or [rss[0][1]])[-1]
    growth = max([mb for t, mb in rss if t >= args.warmup_s], default=at_warmup) - at_warmup
    ratio, rss_limit, p99_limit = judgement["p99_ratio"], args.max_rss_growth_mb, args.max_p99_ratio
    criteria = {
        "rss_growth": {"value_mb": growth, "limit_mb": rss_limit, "passed": growth < rss_limit},
        "errors": {"value": sum(errors.values()), "limit": 0, "passed": not errors},
        "p99_aged_vs_fresh": {"value": ratio, "limit": p99_limit, "passed": ratio <= p99_limit},
    }
    return {
        "requests": {"count": len(records), "by_tag": {t: dict(c) for t, c in sorted(by_tag.items())}},
        "errors": dict(errors),
        "latency_per_10s": per_10s,
        "rss_mb": {"at_warmup_end": at_warmup, "series": rss},
        "judgement": judgement,
        "criteria": criteria,
        "passed": all(c["passed"] for c in criteria.values()),
    }


def report(results: dict[str, Any]) -> None:
    c, j, errors = results["criteria"], results["judgement"], results["errors"]
    lines = ["outcomes per tag:"]
    for tag, outcomes in results["requests"]["by_tag"].items():
        lines.append(f"  {tag:<24} " + ", ".join(f"{o}: {n}" for o, n in sorted(outcomes.items())))
    rounds = ", ".join(f"{r:.3f}" for r in j["p99_ratio_per_round"])
    lines += [
        f"{kit.VERDICT[c['rss_growth']['passed']]} RSS growth after warm-up {c['rss_growth']['value_mb']:+.1f} MiB "
        f"(limit < {c['rss_growth']['limit_mb']:g})",
        f"{kit.VERDICT[c['errors']['passed']]} errors other than bad inputs' 4xx: {c['errors']['value']}"
        + (f" {errors}" if errors else ""),
        f"{kit.VERDICT[c['p99_aged_vs_fresh']['passed']]} p99 aged / fresh {j['p99_ratio']:.3f} (aged "
        f"{j['aged_p99_ms']:.2f} ms, fresh {j['fresh_p99_ms']:.2f} ms at {j['rate']:.1f} req/s; per round "
        f"{rounds}; limit <= {c['p99_aged_vs_fresh']['limit']:g})",
        f"verdict: {'PASS' if results['passed'] else 'FAIL'}",
    ]
    print("\n".join(lines))


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


def main(args: argparse.Namespace) -> int:
    if kit.refused(
        (not 0 <= args.bad_fraction < 1, "--bad-fraction must be in [0, 1)"),
        (not 0 <= args.warmup_s < args.duration_s, "--warmup-s must be in [0, --duration-s)"),
        (not (Path(args.repository) / args.model).is_dir(), f"{args.repository} holds no model {args.model}"),
    ):
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    requests = build_mix(args.model, args.bad_fraction)
    good = [r for r in requests if r.tag.startswith("good")]
    results = kit.header(config=vars(args))
    with launcher.start(args.repository, workers=args.workers, log=out / "server.log") as aged:
        print(f"server at {aged.url} (pid {aged.process.pid}); its log: {out / 'server.log'}")
        if args.rate is None:
            where = kit.bounds(aged.url, 1.0, args.capacity_s, drain_s=5.0, timeout_s=args.timeout_s)
            print(
                f"capacity: open-loop steps of {args.capacity_s:g} s (+1 s not counted), p99 within "
                f"{args.capacity_p99_ms:g} ms and no error",
            )
            bodies = [Payload(r.path, r.headers, r.body, 1) for r in good]
            more = {"start_rate": args.capacity_start_rate, "max_steps": args.capacity_max_steps}
            found = kit.rate_search(args.model, bodies, args.capacity_p99_ms, where, **more)
            results["capacity"] = found.summary()
            if found.best_rate is None:
                print(f"no rate met p99 <= {args.capacity_p99_ms:g} ms with no error", file=sys.stderr)
                return 1
            rate, judge_rate = args.load * found.best_rate, args.judge_load * found.best_rate
            print(f"capacity {found.best_rate:.1f} req/s; soaking at {rate:.1f}")
        else:
            rate = judge_rate = args.rate
        results["rate"] = rate
        print(
            f"soak: {args.duration_s:g} s at {rate:.1f} req/s ({args.warmup_s:g} s warm-up), "
            f"{args.bad_fraction:.0%} bad inputs",
        )
        pid = aged.process.pid
        memory = kit.Sampler(lambda: launcher.tree_rss_mb(pid), 1.0)
        memory.start()
        records = soak(aged.url, requests, rate, args, memory)
        rss = memory.finish()
        with launcher.start(args.repository, workers=args.workers, log=out / "server-fresh.log") as fresh:
            print(
                f"judgement: fresh server at {fresh.url}; {args.judge_rounds} round(s) of {args.judge_window_s:g} s "
                f"windows at {judge_rate:.1f} req/s",
            )
            judgement = judge({"aged": aged.url, "fresh": fresh.url}, good, judge_rate, args)
        results["exit_codes"] = {"fresh": fresh.stop()}
    results["exit_codes"]["aged"] = aged.stop()
    results.update(summarise(records, rss, judgement, args))
    report(results)
    print(f"servers stopped with SIGTERM: exit codes {results['exit_codes']}")
    kit.write_json(out / "soak.json", results)
    plot(results, out / "soak.png", args.warmup_s)
    print(f"wrote {out / 'soak.json'} and {out / 'soak.png'}")
    return 0 if results["passed"] else 1
