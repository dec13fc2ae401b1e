"""Every target of ``visionserve bench many-models``: the figures and verdict from the rounds' answers and samples,
and the report for people, one line per target with PASS or MISS."""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from service.bench.kit import VERDICT, ms, percentile, quantiles

Arrivals = list[tuple[float, str]]  # (due second, model)
Rows = list[dict[str, Any]]


@dataclass
class Answer:
    model: str
    due_s: float
    latency_s: float
    outcome: str  # the status code, or the exception's class name
    label: str | None
    cold_ms: float | None  # Server-Timing's cold_start; None: the model was resident
    timing: str = ""  # the whole Server-Timing header


def ideal_lru(sequence: Sequence[str], capacity: int) -> float:
    """The hit rate of an LRU cache of ``capacity`` models on ``sequence`` (a miss loads at once, evicting the
    least recently used)."""
    cache: OrderedDict[str, None] = OrderedDict()
    hits = 0
    for model in sequence:
        hits += model in cache
        cache[model] = None
        cache.move_to_end(model)
        if len(cache) > capacity:
            cache.popitem(last=False)
    return hits / len(sequence) if sequence else math.nan


def slow_hit(a: Answer) -> dict[str, Any]:
    """One of the slowest hits: its latency and the longest stage of its Server-Timing but the total."""
    stages = {}
    for entry in a.timing.split(","):
        name, _, dur = entry.strip().partition(";dur=")
        with contextlib.suppress(ValueError):
            stages[name] = float(dur)
    stages.pop("total", None)
    s, v = max(stages.items(), key=lambda kv: kv[1], default=("none", 0.0))
    return {"ms": 1000 * a.latency_s, "model": a.model, "largest_stage": s, "stage_ms": v, "server_timing": a.timing}


def beside_loads(answers: Sequence[Answer]) -> dict[str, Any]:
    """Hits split by whether a load ran meanwhile (a miss's wait, ``cold_start`` before its answer, overlapped the
    hit), and the largest Server-Timing stage of the slowest 1% of hits: what the hits' tail waits for."""
    hits = [a for a in answers if a.outcome == "200" and a.cold_ms is None]
    loads = [
        (a.due_s + a.latency_s - a.cold_ms / 1000, a.due_s + a.latency_s)
        for a in answers
        if a.cold_ms is not None and math.isfinite(a.cold_ms)
    ]
    during = [a for a in hits if any(s < a.due_s + a.latency_s and a.due_s < e for s, e in loads)]
    clear = [a for a in hits if a not in during]
    slowest = sorted(hits, key=lambda a: -a.latency_s)[: max(1, len(hits) // 100)]
    return {
        "hits_during_loads": len(during),
        "hits_clear": len(clear),
        **quantiles([a.latency_s for a in during], "during_loads_"),
        **quantiles([a.latency_s for a in clear], "clear_"),
        "slowest": [slow_hit(a) for a in slowest],
    }


def judge(args: argparse.Namespace, size: int, budget: int, sequence: Arrivals, rounds: Rows) -> dict[str, Any]:
    """Every target's figures and verdict."""
    answers = [a for r in rounds for a in r["a"]["answers"]]
    wrong = [a for a in answers if a.label is not None and not a.label.startswith(a.model + "/")]
    five = [a for a in answers if a.outcome.startswith("5")]
    other = [a for a in answers if a.outcome != "200" and not a.outcome.startswith("5")]
    died = [i for i, r in enumerate(rounds) if not (r["a"]["alive"] and r["b"]["alive"])]
    correct = {
        "answers": len(answers),
        "ok": sum(a.outcome == "200" for a in answers),
        "wrong_model": len(wrong),
        "5xx": len(five),
        "other_failures": len(other),
        "server_deaths": len(died),
        "passed": not (wrong or five or other or died) and len(answers) > 0,
    }

    answered = [a for a in answers if a.outcome.isdigit()]
    server_rate = 1 - sum(a.cold_ms is not None for a in answered) / max(1, len(answered))
    models = [m for _, m in sequence]
    ideal = ideal_lru(models, args.capacity)
    resident = [s["resident"] for r in rounds for s in r["a"]["samples"]]
    mean = statistics.fmean(resident) if resident else None
    hits = {
        "server": server_rate,
        "ideal_lru": ideal,
        "points": 100 * (server_rate - ideal),
        "capacity": args.capacity,
        "resident_mean": mean,
        "resident_max": max(resident, default=None),
        "ideal_lru_at_mean_resident": None if mean is None else ideal_lru(models, round(mean)),
    }
    hits["passed"] = abs(hits["points"]) <= args.hit_rate_points

    latency = _latency(args, rounds, answers)
    return {"correct": correct, "hit_rate": hits, "p99_hits": latency, "memory": _memory(args, size, budget, rounds)}


def hit_seconds(answers: Sequence[Answer], models: set[str] | None = None) -> list[float]:
    """The latencies of the hits (answered 200 with no cold start), of ``models`` only when given."""
    hits = [a for a in answers if a.outcome == "200" and a.cold_ms is None]
    return [a.latency_s for a in hits if models is None or a.model in models]


def _latency(args: argparse.Namespace, rounds: list[dict[str, Any]], answers: list[Answer]) -> dict[str, Any]:
    """Hits' latency on demand against the pinned server, per round and pooled."""
    top = {f"m{i:02d}" for i in range(args.capacity)}

    def sides(a: list[Answer], b: list[Answer]) -> dict[str, Any]:
        a_hits, b_all = hit_seconds(a), [x.latency_s for x in b if x.outcome == "200"]
        return {
            **quantiles(a_hits, "a_hits_"),
            "a_top_hits_p99_ms": ms(hit_seconds(a, top), 0.99),
            **quantiles(b_all, "b_"),
            "ratio": ms(a_hits, 0.99) / ms(b_all, 0.99),
        }

    per_round = [{"order": r["order"], **sides(r["a"]["answers"], r["b"]["answers"])} for r in rounds]
    latency = sides([a for r in rounds for a in r["a"]["answers"]], [b for r in rounds for b in r["b"]["answers"]])
    misses = [a.latency_s for a in answers if a.outcome == "200" and a.cold_ms is not None]
    cold_ms = [a.cold_ms for a in answers if a.cold_ms is not None and math.isfinite(a.cold_ms)]
    latency |= {
        "rounds": per_round,
        "ratio_top": latency["a_top_hits_p99_ms"] / latency["b_p99_ms"],
        **quantiles(misses, "a_misses_"),
        "cold_start_p50_ms": percentile(cold_ms, 0.5),
        "cold_start_max_ms": max(cold_ms, default=math.nan),
        "limit": args.p99_ratio,
        "beside_loads": beside_loads(answers),
    }
    latency["passed"] = latency["ratio"] <= args.p99_ratio
    return latency


def _memory(args: argparse.Namespace, size: int, budget: int, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The charged bytes against the budget, and the engine's RSS growth against them."""
    samples = [s for r in rounds for s in r["a"]["samples"]]
    over = [s["charged"] for s in samples if s["charged"] > budget + size]
    ratios = [
        (s["rss"] - r["a"]["rss_empty"]) / s["charged"]
        for r in rounds
        for s in r["a"]["samples"]
        if s["charged"] > 0 and s["rss"] > 0
    ]
    worst = max(ratios, key=lambda x: abs(x - 1), default=math.nan)
    memory = {
        "scrapes": len(samples),
        "budget_bytes": budget,
        "model_bytes": size,
        "max_charged_bytes": max((s["charged"] for s in samples), default=0),
        "over_limit_scrapes": len(over),
        "charged_passed": not over and bool(samples),
        "rss_ratio_worst": worst,
        "rss_ratio_median": statistics.median(ratios) if ratios else math.nan,
        "rss_ratio_min": min(ratios, default=math.nan),
        "rss_ratio_max": max(ratios, default=math.nan),
        "rss_empty_bytes": [r["a"]["rss_empty"] for r in rounds],
        "tolerance": args.rss_tolerance,
        "source": args.scrape_from,
        "read_ms_p50": percentile([s["read_ms"] for s in samples], 0.5),
        "read_ms_max": max((s["read_ms"] for s in samples), default=math.nan),
        "at_end": [r["a"]["end"] for r in rounds],
    }
    memory["rss_passed"] = abs(worst - 1) <= args.rss_tolerance
    return memory


def report(results: dict[str, Any]) -> None:
    c, h, p, m, cs = (results[k] for k in ("correct", "hit_rate", "p99_hits", "memory", "cold_start"))
    bl, end, mb = p["beside_loads"], m["at_end"][-1], 1e6
    sv, tr, first, later = cs["served"], cs["triton"], cs["in_process"]["first"], cs["in_process"]["median_later"]
    rounds = ", ".join(f"{r['ratio']:.2f} ({r['order']})" for r in p["rounds"])
    tail = ", ".join(f"{x['ms']:.0f} ms ({x['largest_stage']} {x['stage_ms']:.0f})" for x in bl["slowest"])

    def parts(x: dict[str, Any]) -> str:
        return (
            f"read {x['read_ms']:.1f} + build {x['build_ms']:.1f} + warm-up {x['warmup_ms']:.1f} = {x['total_ms']:.1f}"
        )

    triton = (
        f"  Triton explicit load {tr['load_ms']:.1f} ms (build {tr.get('build_ms', math.nan):.1f} + warm-up "
        f"{tr.get('warmup_ms', math.nan):.1f}); served cold_start / Triton "
        f"{sv['first_cold_start_ms'] / tr['load_ms']:.2f}"
        if tr["ran"]
        else f"  Triton: not run: {tr['why']}"
    )
    lines = [
        f"\nmodels {results['models']} x {results['arch']}, budget {results['budget_bytes'] / mb:.1f} MB = "
        f"{results['capacity'] + 0.5} x {results['model_bytes'] / mb:.1f} MB measured; {results['rate']:g} req/s "
        f"for {results['duration_s']:g} s x {results['rounds']} round(s), {results['popularity']}",
        f"{VERDICT[c['passed']]} answers from the right model: {c['ok']}/{c['answers']} ok, wrong model "
        f"{c['wrong_model']}, 5xx {c['5xx']}, other failures {c['other_failures']}, server deaths {c['server_deaths']}",
        f"{VERDICT[h['passed']]} hit rate {h['server']:.1%} vs ideal LRU({h['capacity']}) {h['ideal_lru']:.1%}: "
        f"{h['points']:+.1f} points (limit +-{results['limits']['hit_rate_points']:g}); resident models mean "
        f"{h['resident_mean'] or 0:.1f}, max {h['resident_max']} (an ideal LRU of the mean: "
        f"{h['ideal_lru_at_mean_resident'] or math.nan:.1%})",
        f"{VERDICT[p['passed']]} p99 of hits {p['a_hits_p99_ms']:.1f} ms vs pinned {p['b_p99_ms']:.1f} ms: ratio "
        f"{p['ratio']:.2f} (limit {p['limit']:g}); per round {rounds}; top-{h['capacity']} hits only "
        f"{p['a_top_hits_p99_ms']:.1f} ms (ratio {p['ratio_top']:.2f}); p50 hits {p['a_hits_p50_ms']:.1f} vs "
        f"{p['b_p50_ms']:.1f} ms; misses p50 {p['a_misses_p50_ms']:.1f} p99 {p['a_misses_p99_ms']:.1f} ms, "
        f"cold_start p50 {p['cold_start_p50_ms']:.1f} max {p['cold_start_max_ms']:.1f} ms",
        f"  hits while a load ran: {bl['hits_during_loads']}, p50 {bl['during_loads_p50_ms']:.1f} p99 "
        f"{bl['during_loads_p99_ms']:.1f} ms; the others: {bl['hits_clear']}, p50 {bl['clear_p50_ms']:.1f} p99 "
        f"{bl['clear_p99_ms']:.1f} ms; slowest 1% of hits, largest Server-Timing stage: {tail}",
        f"{VERDICT[m['charged_passed']]} charged bytes at most {m['max_charged_bytes'] / mb:.1f} MB over "
        f"{m['scrapes']} reads of {m['source']} every {results['scrape_s']:g} s (limit budget + one model = "
        f"{(m['budget_bytes'] + m['model_bytes']) / mb:.1f} MB); a read took p50 {m['read_ms_p50']:.1f} ms, max "
        f"{m['read_ms_max']:.1f} ms; at the end /metrics said {end['metrics_bytes'] / mb:.1f} MB, /v1/models "
        f"{end['listed_bytes'] / mb:.1f} MB (/metrics took {end['metrics_read_ms']:.0f} ms)",
        f"{VERDICT[m['rss_passed']]} engine RSS growth / charged bytes: worst {m['rss_ratio_worst']:.2f}, median "
        f"{m['rss_ratio_median']:.2f}, range {m['rss_ratio_min']:.2f}..{m['rss_ratio_max']:.2f} (limit 1 +- "
        f"{m['tolerance']:g})",
        f"cold start of {cs['arch']} ({cs['file_bytes'] / mb:.1f} MB file), in process: first {parts(first)} ms; "
        f"later (median) {parts(later)} ms",
        f"  served: first request {sv['first_request_ms']:.1f} ms, its cold_start {sv['first_cold_start_ms']:.1f} "
        f"ms (served / in-process later {sv['first_cold_start_ms'] / later['total_ms']:.2f}); second request "
        f"{sv['second_request_ms']:.1f} ms",
        triton,
    ]
    print("\n".join(lines))
