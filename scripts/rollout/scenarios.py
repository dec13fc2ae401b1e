"""The bench's three runs against real servers: live latency with a shadow and without (interleaved rounds at two
loads), detection (three candidates, each on a server of its own, driven until the rollout decides or the evidence
says what it would decide) and a promotion under load."""

from __future__ import annotations

import argparse
import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from loadtest.openloop import Record, Request, percentile
from rollout import traffic
from rollout.traffic import comparison

KEPT = ("samples", "agreed", "agreement", "agreement_low", "agreement_high", "shed", "attempts", "errors",
        "latency_ratio")  # fmt: skip


def compact(seconds: float, state: dict[str, Any]) -> dict[str, Any]:
    """One poll, the fields a reader follows over time."""
    found = comparison(state)
    return {"t_s": round(seconds, 3), "state": state.get("state"), "verdict": state.get("verdict"),
            **{k: found.get(k) for k in KEPT}}  # fmt: skip


def repository(args: argparse.Namespace, work: Path, name: str, versions: dict[int, Path],
               rollout: dict[str, Any] | None = None) -> Path:  # fmt: skip
    """A fresh repository ``WORK/repos/NAME`` of the model with ``versions``, ``--model-config`` and ``rollout``."""
    return traffic.repository(work / "repos" / name, args.model, versions, rollout, args.model_config)


def shadow_rollout(args: argparse.Namespace, fraction: float, auto: bool) -> dict[str, Any]:
    return {"candidate": 2, "mode": "shadow", "fraction": fraction, "auto": auto,
            "min_agreement": args.min_agreement, "min_samples": args.min_samples}  # fmt: skip


# ---- a: live latency with and without a shadow ----------------------------------------------------------------------
def window(server: Any, args: argparse.Namespace, requests: list[Request], rate: float) -> dict[str, Any]:
    """One open-loop window at ``rate``, the rollout route polled through it."""
    poller = traffic.Poller(server.url, args.model, args.latency_poll_s)
    before = traffic.status(server.url, args.model)
    poller.start()
    records = traffic.open_loop(server.url, requests, rate, args.window_s, args.timeout_s)
    after = poller.finish()[-1][1]
    moved = {k: (comparison(after).get(k) or 0) - (comparison(before).get(k) or 0) for k in ("samples", "shed")}
    return {**traffic.latency(records), "state": after.get("state"), **moved, "_ok_s": ok_seconds(records)}


def ok_seconds(records: list[Record]) -> list[float]:
    return [r.latency_s for r in records if r.outcome == "200"]


def latency_runs(args: argparse.Namespace, work: Path, primary: Path, copy: Path, requests: list[Request],
                 capacity: float) -> dict[str, Any]:  # fmt: skip
    """A server with a shadow of a copy of the primary (``--shadow-fraction``, auto off: it never decides) and one
    without, both up throughout, taking turns (AB, BA, ...) at each load; p50/p99 pooled per side and load."""
    shadow_repo = repository(args, work, "shadow", {1: primary, 2: copy},
                             shadow_rollout(args, args.shadow_fraction, auto=False))  # fmt: skip
    plain_repo = repository(args, work, "plain", {1: primary})
    loads: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        logs = work / "logs"
        servers = {"shadow": stack.enter_context(traffic.start(shadow_repo, logs / "shadow.log", args)),
                   "none": stack.enter_context(traffic.start(plain_repo, logs / "plain.log", args))}  # fmt: skip
        traffic.wait_state(servers["shadow"].url, args.model, ["running"])
        for load in (args.load, args.high_load):
            rate = load * capacity
            for server in servers.values():  # not counted: connections, the first batches
                traffic.open_loop(server.url, requests, rate, 1.0, args.timeout_s)
            windows: list[dict[str, Any]] = []
            for k in range(args.rounds):
                for side in ("shadow", "none") if k % 2 == 0 else ("none", "shadow"):
                    done = window(servers[side], args, requests, rate)
                    windows.append({"round": k + 1, "side": side, **done})
                    print(f"  {load:.0%} of capacity ({rate:.0f} req/s), round {k + 1}, {side:<6}: {done['ok']}/"
                          f"{done['count']} ok, p50 {done['p50_ms']:.2f} ms, p99 {done['p99_ms']:.2f} ms"
                          + (f", shadow samples {done['samples']}, shed {done['shed']}" if side == "shadow" else ""),
                          flush=True)  # fmt: skip
            loads.append(judge_load(args, load, rate, windows))
    return {"capacity": capacity, "shadow_fraction": args.shadow_fraction, "loads": loads,
            "passed": all(x["passed"] for x in loads)}  # fmt: skip


def judge_load(args: argparse.Namespace, load: float, rate: float, windows: list[dict[str, Any]]) -> dict[str, Any]:
    pooled: dict[str, dict[str, Any]] = {}
    for side in ("shadow", "none"):
        mine = [w for w in windows if w["side"] == side]
        ok = [s for w in mine for s in w["_ok_s"]]
        count = sum(w["count"] for w in mine)
        pooled[side] = {"count": count, "ok": len(ok), "errors": count - len(ok),
                        "p50_ms": 1000 * percentile(ok, 0.5), "p99_ms": 1000 * percentile(ok, 0.99)}  # fmt: skip
    shadow = [w for w in windows if w["side"] == "shadow"]
    figures = {"load": load, "rate": rate, "shadow": pooled["shadow"], "none": pooled["none"],
               "p50_ratio": pooled["shadow"]["p50_ms"] / pooled["none"]["p50_ms"],
               "p99_ratio": pooled["shadow"]["p99_ms"] / pooled["none"]["p99_ms"],
               "shadow_samples": sum(w["samples"] for w in shadow), "shed": sum(w["shed"] for w in shadow),
               "rollout_state": shadow[-1]["state"] if shadow else None,
               "windows": [{k: v for k, v in w.items() if k != "_ok_s"} for w in windows]}  # fmt: skip
    if load == args.high_load:  # the issue: at 95%, live p99 within 10%; at 60%, p50 and p99 within 5%
        figures["p99_passed"] = figures["p99_ratio"] <= args.max_p99_ratio
    else:
        figures["p99_passed"] = max(figures["p50_ratio"], figures["p99_ratio"]) <= args.max_ratio
    figures["errors_passed"] = pooled["shadow"]["errors"] == 0 and pooled["none"]["errors"] == 0
    figures["shed_passed"] = figures["shed"] > 0 if load == args.high_load else None
    figures["passed"] = figures["p99_passed"] and figures["errors_passed"] and figures["shed_passed"] is not False
    return figures


# ---- b: detection -------------------------------------------------------------------------------------------------
def trial(args: argparse.Namespace, work: Path, name: str, primary: Path, candidate: Path, rollout: dict[str, Any],
          done: Callable[[dict[str, Any]], bool], requests: list[Request]) -> dict[str, Any]:  # fmt: skip
    """A server with ``candidate`` in a rollout beside ``primary``, sent the held-out stream at ``--detect-rate`` in
    one-second windows until ``done(status)``, the rollout decides, ``--detect-max-samples`` are compared or twice
    the time those take at that rate passes. The route is polled every ``--poll-s``."""
    repo = repository(args, work, name, {1: primary, 2: candidate}, rollout)
    records: list[Record] = []
    with traffic.start(repo, work / "logs" / f"{name}.log", args) as server:
        traffic.wait_state(server.url, args.model, ["running"])
        poller = traffic.Poller(server.url, args.model, args.poll_s)
        poller.start()
        began, offset, printed = time.perf_counter(), 0, 0.0
        budget_s = 2 * args.detect_max_samples / args.detect_rate + 10
        while time.perf_counter() - began < budget_s:
            latest = poller.latest()
            if latest and (done(latest) or latest.get("state") != "running"
                           or (comparison(latest).get("samples") or 0) >= args.detect_max_samples):  # fmt: skip
                break
            turned = requests[offset % len(requests) :] + requests[: offset % len(requests)]
            records += traffic.open_loop(server.url, turned, args.detect_rate, 1.0, args.timeout_s)
            offset += int(args.detect_rate)
            if time.perf_counter() - printed >= 2.0:
                printed = time.perf_counter()
                now = compact(0.0, poller.latest())
                print(f"  {name}: {now['samples']} samples, agreement {now['agreement']} [{now['agreement_low']}, "
                      f"{now['agreement_high']}], verdict {now['verdict']}, state {now['state']}",
                      flush=True)  # fmt: skip
        history = [compact(t, s) for t, s in poller.finish()]
        final = poller.latest()
    return {"rollout": rollout, "rate": args.detect_rate, "requests": traffic.latency(records), "history": history,
            "final": final, "poll_failures": dict(poller.failures)}  # fmt: skip


def first(history: list[dict[str, Any]], test: Callable[[dict[str, Any]], bool]) -> tuple[int | None, int | None]:
    """The samples at the first poll passing ``test``, and at the poll before it (the bracket polling leaves)."""
    for i, poll in enumerate(history):
        if test(poll):
            return poll["samples"], history[i - 1]["samples"] if i else 0
    return None, None


def decided_at(history: list[dict[str, Any]], state: str) -> int | None:
    """The samples compared when the rollout reached ``state``: at the first poll in it, or, where the comparison is
    reset by the decision, the last poll before it."""
    at, before = first(history, lambda p: p["state"] == state)
    if at is None:
        return None
    return at if at else before


def detection(args: argparse.Namespace, work: Path, primary: Path, built: dict[str, Path],
              requests: list[Request]) -> dict[str, Any]:  # fmt: skip
    low = args.min_agreement

    def excluding(poll: dict[str, Any]) -> bool:
        return poll.get("agreement_high") is not None and poll["agreement_high"] < low

    def seen_enough(status: dict[str, Any]) -> bool:  # past --detect-samples, and excluding 0.99 then
        return (comparison(status).get("samples") or 0) >= args.detect_samples and excluding(comparison(status))

    detect = trial(args, work, "detect", primary, built["detect"], shadow_rollout(args, 1.0, auto=False), seen_enough,
                   requests)  # fmt: skip
    history = detect["history"]
    excluded, before = first(history, excluding)
    stays = next((history[i]["samples"] for i in range(len(history))
                  if all(excluding(p) for p in history[i:])), None)  # fmt: skip
    detect |= {"excluded_at_samples": excluded, "poll_before_samples": before, "excluded_for_good_at_samples": stays,
               "passed": excluded is not None and excluded <= args.detect_max_samples
               and stays is not None and stays <= args.detect_max_samples}  # fmt: skip
    promote = trial(args, work, "promote", primary, built["promote"], shadow_rollout(args, 1.0, auto=True),
                    lambda s: s.get("state") == "promoted", requests)  # fmt: skip
    promote |= {"promoted_at_samples": decided_at(promote["history"], "promoted")}
    promote["passed"] = promote["final"].get("state") == "promoted"
    permuted = trial(args, work, "permuted", primary, built["permuted"], shadow_rollout(args, 1.0, auto=True),
                     lambda s: s.get("state") == "aborted", requests)  # fmt: skip
    at = decided_at(permuted["history"], "aborted")
    permuted |= {"aborted_at_samples": at, "passed": permuted["final"].get("state") == "aborted"
                 and at is not None and at <= args.abort_within}  # fmt: skip
    return {"detect": detect, "promote": promote, "permuted": permuted,
            "passed": detect["passed"] and promote["passed"] and permuted["passed"]}  # fmt: skip


# ---- c: promotion under load ----------------------------------------------------------------------------------------
def promotion(args: argparse.Namespace, work: Path, primary: Path, copy: Path, requests: list[Request],
              capacity: float) -> dict[str, Any]:  # fmt: skip
    """An open loop at ``--load`` x capacity on a server shadowing a copy, promoted through the admin API at
    ``--promote-at`` of ``--promote-s``: every request must be answered 200."""
    repo = repository(args, work, "promotion", {1: primary, 2: copy},
                      shadow_rollout(args, args.shadow_fraction, auto=False))  # fmt: skip
    rate, at_s = args.load * capacity, args.promote_s * args.promote_at
    call: dict[str, Any] = {}
    with traffic.start(repo, work / "logs" / "promotion.log", args) as server:
        traffic.wait_state(server.url, args.model, ["running"])

        def promote() -> None:
            began = time.perf_counter()
            reason = {"reason": "rollout_bench: promotion under load"}
            path = traffic.rollout_path(args.model) + "/promote"
            code, body = traffic.admin_post(server.url, path, args.admin_token, reason)
            call.update(status=code, body=body, took_ms=1000 * (time.perf_counter() - began))

        poller = traffic.Poller(server.url, args.model, args.latency_poll_s)
        poller.start()
        timer = threading.Timer(at_s, promote)
        timer.start()
        records = traffic.open_loop(server.url, requests, rate, args.promote_s, args.timeout_s,
                                    on_tick=lambda t: print(f"  promotion run: {t:.0f} s", flush=True)
                                    if round(t) % 5 == 0 else None)  # fmt: skip
        timer.join()
        history = [compact(t, s) for t, s in poller.finish()]
        final = poller.latest()
        versions = answered_versions(server.url, args.model, requests[:20])
    sent = int(rate * args.promote_s)
    failed = [r for r in records if r.outcome != "200"]
    near = [r.latency_s for r in records if r.outcome == "200" and abs(r.due_s - at_s) <= 1.0]
    figures = {"rate": rate, "duration_s": args.promote_s, "promote_at_s": at_s, "promote_call": call,
               "sent": sent, "recorded": len(records), "failed": len(failed), "lost": sent - len(records),
               "failures": dict(traffic.latency(failed)["outcomes"]), "latency": traffic.latency(records),
               "p99_ms_within_1s_of_promotion": 1000 * percentile(near, 0.99), "final_state": final.get("state"),
               "final_primary": final.get("primary"), "versions_after": versions, "history": history}  # fmt: skip
    figures["passed"] = (call.get("status") == 200 and not failed and len(records) == sent
                         and final.get("state") == "promoted" and set(versions) == {"2"})  # fmt: skip
    return figures


def answered_versions(url: str, model: str, requests: list[Request]) -> dict[str, int]:
    """Which versions answer requests naming none (``version`` of the classify answer), counted."""
    counts: dict[str, int] = {}
    with httpx.Client(base_url=url, timeout=30) as client:
        for request in requests:
            answer = client.post(request.path, content=request.body, headers=request.headers)
            key = str(answer.json().get("version")) if answer.status_code == 200 else f"HTTP {answer.status_code}"
            counts[key] = counts.get(key, 0) + 1
    return counts
