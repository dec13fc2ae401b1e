"""The bench's printed report: each target's figures and verdict."""

from __future__ import annotations

from typing import Any

VERDICT = {True: "PASS", False: "MISS", None: "----"}


def _n(value: Any, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def report(results: dict[str, Any]) -> None:
    cap = results["capacity"]
    how = "given" if cap.get("given") else f"closed loop, {cap.get('clients')} clients, {cap.get('duration_s')} s"
    print(f"\ncapacity: {cap['requests_per_s']:.0f} requests/s ({how})")
    if "latency" in results:
        _latency(results["latency"], results["limits"])
    if "detection" in results:
        _detection(results["detection"], results["limits"])
    if "promotion" in results:
        _promotion(results["promotion"])


def _latency(a: dict[str, Any], limits: dict[str, Any]) -> None:
    print(f"a. live latency with a {a['shadow_fraction']:.0%} shadow against none (interleaved rounds, pooled):")
    for x in a["loads"]:
        s, n = x["shadow"], x["none"]
        shed = f"; shadow samples {x['shadow_samples']}, shed {x['shed']}"
        if x["shed_passed"] is not None:
            shed += " (target > 0)"
        key, what = ("max_ratio", "p50 and p99") if x["shed_passed"] is None else ("max_p99_ratio", "p99")
        print(f"  {VERDICT[x['passed']]} {x['load']:.0%} of capacity ({x['rate']:.0f} req/s): p50 {s['p50_ms']:.2f} vs "
              f"{n['p50_ms']:.2f} ms ({x['p50_ratio']:.3f}x), p99 {s['p99_ms']:.2f} vs {n['p99_ms']:.2f} ms "
              f"({x['p99_ratio']:.3f}x), target <= {limits[key]:g}x ({what}), errors {s['errors']} / "
              f"{n['errors']}{shed}")  # fmt: skip


def _detection(b: dict[str, Any], limits: dict[str, Any]) -> None:
    print("b. detection (shadow of every request):")
    d, most = b["detect"], limits["detect_max_samples"]
    print(f"  {VERDICT[d['passed']]} a candidate disagreeing on {d['offline_disagreement']:.2%} of the held-out "
          f"stream (auto off): agreement_high < {limits['min_agreement']:g} at {_n(d['excluded_at_samples'])} "
          f"samples (poll before: {_n(d['poll_before_samples'])}), and from {_n(d['excluded_for_good_at_samples'])} "
          f"samples on to the run's end at {_n(d['history'][-1]['samples'])} (target <= {most})")  # fmt: skip
    p = b["promote"]
    print(f"  {VERDICT[p['passed']]} a candidate disagreeing on {p['offline_disagreement']:.2%} (auto on): state "
          f"{p['final'].get('state')}, promoted at {_n(p['promoted_at_samples'])} samples; "
          f"{p['final'].get('verdict_reason', '')}")  # fmt: skip
    q = b["permuted"]
    print(f"  {VERDICT[q['passed']]} a label-permuted candidate (auto on): state {q['final'].get('state')}, aborted "
          f"at {_n(q['aborted_at_samples'])} samples (target <= {limits['abort_within']}); "
          f"{q['final'].get('reason', '')}")  # fmt: skip


def _promotion(c: dict[str, Any]) -> None:
    call = c["promote_call"]
    print(f"c. promotion under load ({c['rate']:.0f} req/s for {c['duration_s']:g} s, promoted at "
          f"{c['promote_at_s']:g} s):")  # fmt: skip
    print(f"  {VERDICT[c['passed']]} {c['sent']} sent, {c['recorded']} answered or failed, {c['failed']} failed "
          f"{c['failures'] or ''}, {c['lost']} lost; promote call {call.get('status')} in "
          f"{_n(call.get('took_ms'), 1)} ms; p99 {c['latency']['p99_ms']:.2f} ms overall, "
          f"{c['p99_ms_within_1s_of_promotion']:.2f} ms within 1 s of the promotion; state {c['final_state']}, "
          f"primary {c['final_primary']}, answers after by version {c['versions_after']}")  # fmt: skip
