"""Every target's figures and verdict, from the rounds' answers and samples."""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
from collections.abc import Sequence
from typing import Any

from loadtest.openloop import percentile
from manymodels.traffic import Answer, ideal_lru


def ms(values: Sequence[float], q: float) -> float:
    return 1000 * percentile(values, q)


def stages(timing: str) -> dict[str, float]:
    """A Server-Timing value as {stage: ms}."""
    out = {}
    for entry in timing.split(","):
        name, _, dur = entry.strip().partition(";dur=")
        with contextlib.suppress(ValueError):
            out[name] = float(dur)
    return out


def beside_loads(answers: Sequence[Answer]) -> dict[str, Any]:
    """Hits split by whether a load ran meanwhile (a miss's wait, ``cold_start`` before its answer, overlapped the
    hit), and the largest Server-Timing stage of the slowest 1% of hits: what the hits' tail waits for."""
    hits = [a for a in answers if a.outcome == "200" and a.cold_ms is None]
    loads = [(a.due_s + a.latency_s - a.cold_ms / 1000, a.due_s + a.latency_s) for a in answers
             if a.cold_ms is not None and math.isfinite(a.cold_ms)]  # fmt: skip
    during = [a for a in hits if any(s < a.due_s + a.latency_s and a.due_s < e for s, e in loads)]
    clear = [a for a in hits if a not in during]
    slowest = sorted(hits, key=lambda a: -a.latency_s)[: max(1, len(hits) // 100)]
    largest = [max(((k, v) for k, v in stages(a.timing).items() if k != "total"), key=lambda kv: kv[1],
                   default=("none", 0.0)) for a in slowest]  # fmt: skip
    during_s, clear_s = [a.latency_s for a in during], [a.latency_s for a in clear]
    return {"hits_during_loads": len(during), "hits_clear": len(clear), "during_loads_p50_ms": ms(during_s, 0.5),
            "during_loads_p99_ms": ms(during_s, 0.99), "clear_p50_ms": ms(clear_s, 0.5),
            "clear_p99_ms": ms(clear_s, 0.99),
            "slowest": [{"ms": 1000 * a.latency_s, "model": a.model, "largest_stage": stage, "stage_ms": v,
                         "server_timing": a.timing}
                        for a, (stage, v) in zip(slowest, largest, strict=True)]}  # fmt: skip


def judge(args: argparse.Namespace, size: int, budget: int, sequence: list[tuple[float, str]],
          rounds: list[dict[str, Any]], cold: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """Every target's figures and verdict."""
    answers = [a for r in rounds for a in r["a"]["answers"]]
    wrong = [a for a in answers if a.label is not None and not a.label.startswith(a.model + "/")]
    five = [a for a in answers if a.outcome.startswith("5")]
    other = [a for a in answers if a.outcome != "200" and not a.outcome.startswith("5")]
    died = [i for i, r in enumerate(rounds) if not (r["a"]["alive"] and r["b"]["alive"])]
    correct = {"answers": len(answers), "ok": sum(a.outcome == "200" for a in answers), "wrong_model": len(wrong),
               "5xx": len(five), "other_failures": len(other), "server_deaths": len(died),
               "passed": not (wrong or five or other or died) and len(answers) > 0}  # fmt: skip

    answered = [a for a in answers if a.outcome.isdigit()]
    server_rate = 1 - sum(a.cold_ms is not None for a in answered) / max(1, len(answered))
    ideal = ideal_lru([m for _, m in sequence], args.capacity)
    resident = [s["resident"] for r in rounds for s in r["a"]["samples"]]
    hits = {"server": server_rate, "ideal_lru": ideal, "points": 100 * (server_rate - ideal),
            "capacity": args.capacity, "resident_mean": statistics.fmean(resident) if resident else None,
            "resident_max": max(resident, default=None),
            "ideal_lru_at_mean_resident": ideal_lru([m for _, m in sequence], round(statistics.fmean(resident)))
            if resident else None}  # fmt: skip
    hits["passed"] = abs(hits["points"]) <= args.hit_rate_points

    top = {m for m in [f"m{i:02d}" for i in range(args.capacity)]}
    per_round = []
    for r in rounds:
        a_hits = [a.latency_s for a in r["a"]["answers"] if a.outcome == "200" and a.cold_ms is None]
        a_top = [a.latency_s for a in r["a"]["answers"] if a.outcome == "200" and a.cold_ms is None and a.model in top]
        b_all = [a.latency_s for a in r["b"]["answers"] if a.outcome == "200"]
        per_round.append({"order": r["order"], "a_hits_p50_ms": ms(a_hits, 0.5), "a_hits_p99_ms": ms(a_hits, 0.99),
                          "a_top_hits_p99_ms": ms(a_top, 0.99), "b_p50_ms": ms(b_all, 0.5),
                          "b_p99_ms": ms(b_all, 0.99), "ratio": ms(a_hits, 0.99) / ms(b_all, 0.99)})  # fmt: skip
    pooled_a = [a.latency_s for r in rounds for a in r["a"]["answers"] if a.outcome == "200" and a.cold_ms is None]
    pooled_at = [a.latency_s for r in rounds for a in r["a"]["answers"]
                 if a.outcome == "200" and a.cold_ms is None and a.model in top]  # fmt: skip
    pooled_b = [a.latency_s for r in rounds for a in r["b"]["answers"] if a.outcome == "200"]
    misses = [a.latency_s for a in answers if a.outcome == "200" and a.cold_ms is not None]
    cold_ms = [a.cold_ms for a in answers if a.cold_ms is not None and math.isfinite(a.cold_ms)]
    latency = {"rounds": per_round, "a_hits_p50_ms": ms(pooled_a, 0.5), "a_hits_p99_ms": ms(pooled_a, 0.99),
               "a_top_hits_p99_ms": ms(pooled_at, 0.99), "b_p50_ms": ms(pooled_b, 0.5), "b_p99_ms": ms(pooled_b, 0.99),
               "ratio": ms(pooled_a, 0.99) / ms(pooled_b, 0.99), "ratio_top": ms(pooled_at, 0.99) / ms(pooled_b, 0.99),
               "a_misses_p50_ms": ms(misses, 0.5), "a_misses_p99_ms": ms(misses, 0.99),
               "cold_start_p50_ms": percentile(cold_ms, 0.5), "cold_start_max_ms": max(cold_ms, default=math.nan),
               "limit": args.p99_ratio, "beside_loads": beside_loads(answers)}  # fmt: skip
    latency["passed"] = latency["ratio"] <= args.p99_ratio

    samples = [s for r in rounds for s in r["a"]["samples"]]
    over = [s["charged"] for s in samples if s["charged"] > budget + size]
    ratios = [(s["rss"] - r["a"]["rss_empty"]) / s["charged"] for r in rounds for s in r["a"]["samples"]
              if s["charged"] > 0 and s["rss"] > 0]  # fmt: skip
    worst = max(ratios, key=lambda x: abs(x - 1), default=math.nan)
    memory = {"scrapes": len(samples), "budget_bytes": budget, "model_bytes": size,
              "max_charged_bytes": max((s["charged"] for s in samples), default=0), "over_limit_scrapes": len(over),
              "charged_passed": not over and bool(samples), "rss_ratio_worst": worst,
              "rss_ratio_median": statistics.median(ratios) if ratios else math.nan,
              "rss_ratio_min": min(ratios, default=math.nan), "rss_ratio_max": max(ratios, default=math.nan),
              "rss_empty_bytes": [r["a"]["rss_empty"] for r in rounds], "tolerance": args.rss_tolerance,
              "source": args.scrape_from, "read_ms_p50": percentile([s["read_ms"] for s in samples], 0.5),
              "read_ms_max": max((s["read_ms"] for s in samples), default=math.nan),
              "at_end": [r["a"]["end"] for r in rounds]}  # fmt: skip
    memory["rss_passed"] = abs(worst - 1) <= args.rss_tolerance
    return {"correct": correct, "hit_rate": hits, "p99_hits": latency, "memory": memory, "cold_start": cold}
