"""The report for people, one line per target with PASS or MISS, and the figures made fit for JSON."""

from __future__ import annotations

import math
from typing import Any

VERDICT = {True: "PASS", False: "MISS"}


def report(results: dict[str, Any]) -> None:
    c, h, p, m, cs = (results[k] for k in ("correct", "hit_rate", "p99_hits", "memory", "cold_start"))
    mb = 1e6
    print(f"\nmodels {results['models']} x {results['arch']}, budget {results['budget_bytes'] / mb:.1f} MB = "
          f"{results['capacity'] + 0.5} x {results['model_bytes'] / mb:.1f} MB measured; {results['rate']:g} req/s "
          f"for {results['duration_s']:g} s x {results['rounds']} round(s), {results['popularity']}")  # fmt: skip
    print(f"{VERDICT[c['passed']]} answers from the right model: {c['ok']}/{c['answers']} ok, wrong model "
          f"{c['wrong_model']}, 5xx {c['5xx']}, other failures {c['other_failures']}, server deaths "
          f"{c['server_deaths']}")  # fmt: skip
    print(f"{VERDICT[h['passed']]} hit rate {100 * h['server']:.1f}% vs ideal LRU({h['capacity']}) "
          f"{100 * h['ideal_lru']:.1f}%: {h['points']:+.1f} points (limit +-{results['limits']['hit_rate_points']:g}); "
          f"resident models mean {h['resident_mean'] or 0:.1f}, max {h['resident_max']} (an ideal LRU of the mean: "
          f"{100 * (h['ideal_lru_at_mean_resident'] or math.nan):.1f}%)")  # fmt: skip
    rounds = ", ".join(f"{r['ratio']:.2f} ({r['order']})" for r in p["rounds"])
    print(f"{VERDICT[p['passed']]} p99 of hits {p['a_hits_p99_ms']:.1f} ms vs pinned {p['b_p99_ms']:.1f} ms: ratio "
          f"{p['ratio']:.2f} (limit {p['limit']:g}); per round {rounds}; top-{h['capacity']} hits only "
          f"{p['a_top_hits_p99_ms']:.1f} ms (ratio {p['ratio_top']:.2f}); p50 hits {p['a_hits_p50_ms']:.1f} vs "
          f"{p['b_p50_ms']:.1f} ms; misses p50 {p['a_misses_p50_ms']:.1f} p99 {p['a_misses_p99_ms']:.1f} ms, "
          f"cold_start p50 {p['cold_start_p50_ms']:.1f} max {p['cold_start_max_ms']:.1f} ms")  # fmt: skip
    bl = p["beside_loads"]
    tail = ", ".join(f"{x['ms']:.0f} ms ({x['largest_stage']} {x['stage_ms']:.0f})" for x in bl["slowest"])
    print(f"  hits while a load ran: {bl['hits_during_loads']}, p50 {bl['during_loads_p50_ms']:.1f} p99 "
          f"{bl['during_loads_p99_ms']:.1f} ms; the others: {bl['hits_clear']}, p50 {bl['clear_p50_ms']:.1f} p99 "
          f"{bl['clear_p99_ms']:.1f} ms; slowest 1% of hits, largest Server-Timing stage: {tail}")  # fmt: skip
    print(f"{VERDICT[m['charged_passed']]} charged bytes at most {m['max_charged_bytes'] / mb:.1f} MB over "
          f"{m['scrapes']} reads of {m['source']} every {results['scrape_s']:g} s (limit budget + one model = "
          f"{(m['budget_bytes'] + m['model_bytes']) / mb:.1f} MB); a read took p50 {m['read_ms_p50']:.1f} ms, max "
          f"{m['read_ms_max']:.1f} ms; at the end /metrics said {m['at_end'][-1]['metrics_bytes'] / mb:.1f} MB, "
          f"/v1/models {m['at_end'][-1]['listed_bytes'] / mb:.1f} MB (/metrics took "
          f"{m['at_end'][-1]['metrics_read_ms']:.0f} ms)")  # fmt: skip
    print(f"{VERDICT[m['rss_passed']]} engine RSS growth / charged bytes: worst {m['rss_ratio_worst']:.2f}, median "
          f"{m['rss_ratio_median']:.2f}, range {m['rss_ratio_min']:.2f}..{m['rss_ratio_max']:.2f} (limit 1 +- "
          f"{m['tolerance']:g})")  # fmt: skip
    ip, sv, tr = cs["in_process"], cs["served"], cs["triton"]
    first, later = ip["first"], ip["median_later"]
    print(f"cold start of {cs['arch']} ({cs['file_bytes'] / mb:.1f} MB file), in process: first read "
          f"{first['read_ms']:.1f} + build {first['build_ms']:.1f} + warm-up {first['warmup_ms']:.1f} = "
          f"{first['total_ms']:.1f} ms; later (median) read {later['read_ms']:.1f} + build {later['build_ms']:.1f} "
          f"+ warm-up {later['warmup_ms']:.1f} = {later['total_ms']:.1f} ms")  # fmt: skip
    print(f"  served: first request {sv['first_request_ms']:.1f} ms, its cold_start {sv['first_cold_start_ms']:.1f} "
          f"ms (served / in-process later {sv['first_cold_start_ms'] / later['total_ms']:.2f}); second request "
          f"{sv['second_request_ms']:.1f} ms")  # fmt: skip
    if tr["ran"]:
        print(f"  Triton explicit load {tr['load_ms']:.1f} ms (build {tr.get('build_ms', math.nan):.1f} + warm-up "
              f"{tr.get('warmup_ms', math.nan):.1f}); served cold_start / Triton "
              f"{sv['first_cold_start_ms'] / tr['load_ms']:.2f}")  # fmt: skip
    else:
        print(f"  Triton: not run: {tr['why']}")


def json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value
