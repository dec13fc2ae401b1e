"""The rollout bench's talk with its servers (repositories, the rollout route polled, the admin calls) and its three
runs against them: live latency with a shadow and without (interleaved rounds at two loads), detection (three
candidates, each on a server of its own, driven until the rollout decides or the evidence says what it would decide)
and a promotion under load."""

from __future__ import annotations

import argparse
import contextlib
import functools
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from loadtest.inputs import model_path
from loadtest.openloop import Record, Request
from service import launcher
from service.bench.kit import Sampler, config_toml, latency, ms, ok_seconds, open_loop, quantiles, take_turns
from service.bench.kit import repository as kit_repository


def start(repo: Path, log: Path, args: Any) -> launcher.RunningServer:
    """A server on ``repo`` with the bench's workers and admin token, ready."""
    return launcher.start(
        repo, "--workers", str(args.workers), "--admin-token", args.admin_token, log=log, ready_timeout_s=300
    )


# ---- the rollout route ----------------------------------------------------------------------------------------------
def rollout_path(model: str) -> str:
    return f"/v2/models/{model}/rollout"


def status(url: str, model: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """``GET /v2/models/{model}/rollout``; RuntimeError naming the answer when it is not a 200."""
    answer = httpx.get(url + rollout_path(model), timeout=timeout_s)
    if answer.status_code != 200:
        raise RuntimeError(f"GET {rollout_path(model)} answered {answer.status_code}: {answer.text[:300]}")
    body: dict[str, Any] = answer.json()
    return body


def admin_post(
    url: str, path: str, token: str, body: dict[str, Any] | None = None, timeout_s: float = 30.0
) -> tuple[int, dict[str, Any] | str]:
    """POST an admin call; (status, its JSON body, or its text when it is not JSON)."""
    answer = httpx.post(url + path, json=body or {}, headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s)
    try:
        return answer.status_code, answer.json()
    except ValueError:
        return answer.status_code, answer.text


def wait_state(url: str, model: str, states: Sequence[str], timeout_s: float = 60.0) -> dict[str, Any]:
    """Until the rollout's state is one of ``states``; its status. RuntimeError with the last one otherwise."""
    deadline = time.monotonic() + timeout_s
    current: dict[str, Any] = {}
    while time.monotonic() < deadline:
        current = status(url, model)
        if current.get("state") in states:
            return current
        time.sleep(0.1)
    raise RuntimeError(f"the rollout of {model} at {url} was not {'/'.join(states)} in {timeout_s:g} s: {current}")


def comparison(state: dict[str, Any]) -> dict[str, Any]:
    value: dict[str, Any] = state.get("comparison") or {}
    return value


def requests_for(model: str, pngs: Sequence[bytes]) -> list[Request]:
    """One classify request per image, naming no version (only those take part in a rollout)."""
    path = model_path("image", model)
    return [Request(path, png, {"content-type": "image/png"}, "digit") for png in pngs]


def poller(url: str, model: str, interval_s: float) -> Sampler[dict[str, Any]]:
    """``GET /v2/models/{m}/rollout`` every ``interval_s`` on a thread of its own, started."""
    polls = Sampler(lambda: status(url, model), interval_s, (httpx.HTTPError, RuntimeError, ValueError))
    polls.start()
    return polls


KEPT = (
    "samples",
    "agreed",
    "agreement",
    "agreement_low",
    "agreement_high",
    "shed",
    "attempts",
    "errors",
    "latency_ratio",
)


def compact(seconds: float, state: dict[str, Any]) -> dict[str, Any]:
    """One poll, the fields a reader follows over time."""
    found = comparison(state)
    return {
        "t_s": round(seconds, 3),
        "state": state.get("state"),
        "verdict": state.get("verdict"),
        **{k: found.get(k) for k in KEPT},
    }


def repository(
    args: argparse.Namespace, work: Path, name: str, versions: dict[int, Path], rollout: dict[str, Any] | None = None
) -> Path:
    """A fresh repository ``WORK/repos/NAME`` of the model with ``versions``, ``--model-config`` and ``rollout``."""
    config = "".join(line + "\n" for line in args.model_config.splitlines()) + config_toml(rollout=rollout)
    return kit_repository(work / "repos" / name, {args.model: (versions, config)})


def shadow_rollout(args: argparse.Namespace, fraction: float, auto: bool) -> dict[str, Any]:
    return {
        "candidate": 2,
        "mode": "shadow",
        "fraction": fraction,
        "auto": auto,
        "min_agreement": args.min_agreement,
        "min_samples": args.min_samples,
    }


# ---- a: live latency with and without a shadow ----------------------------------------------------------------------
def window(servers: dict[str, Any], args: argparse.Namespace, requests: list[Request], load: float, rate: float,
           side: str, k: int) -> tuple[dict[str, Any], list[float]]:  # fmt: skip
    """Round ``k``'s open-loop window on ``side`` at ``rate`` (``load`` x capacity), the rollout route polled through
    it; its figures and latencies."""
    url = servers[side].url
    before = status(url, args.model)
    polls = poller(url, args.model, args.latency_poll_s)
    records = open_loop(url, requests, rate, args.window_s, timeout_s=args.timeout_s)
    after = polls.finish()[-1][1]
    moved = {k: (comparison(after).get(k) or 0) - (comparison(before).get(k) or 0) for k in ("samples", "shed")}
    done = {**latency(records), "state": after.get("state"), **moved}
    print(
        f"  {load:.0%} of capacity ({rate:.0f} req/s), round {k}, {side:<6}: {done['ok']}/{done['count']} ok, p50 "
        f"{done['p50_ms']:.2f} ms, p99 {done['p99_ms']:.2f} ms"
        + (f", shadow samples {done['samples']}, shed {done['shed']}" if side == "shadow" else ""),
        flush=True,
    )
    return done, ok_seconds(records)


def latency_runs(
    args: argparse.Namespace, work: Path, primary: Path, copy: Path, requests: list[Request], capacity: float
) -> dict[str, Any]:
    """A server with a shadow of a copy of the primary (``--shadow-fraction``, auto off: it never decides) and one
    without, both up throughout, taking turns (AB, BA, ...) at each load; p50/p99 pooled per side and load."""
    shadow_repo = repository(
        args, work, "shadow", {1: primary, 2: copy}, shadow_rollout(args, args.shadow_fraction, auto=False)
    )
    plain_repo = repository(args, work, "plain", {1: primary})
    loads: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        logs = work / "logs"
        servers = {
            "shadow": stack.enter_context(start(shadow_repo, logs / "shadow.log", args)),
            "none": stack.enter_context(start(plain_repo, logs / "plain.log", args)),
        }
        wait_state(servers["shadow"].url, args.model, ["running"])
        for load in (args.load, args.high_load):
            rate = load * capacity
            for server in servers.values():  # not counted: connections, the first batches
                open_loop(server.url, requests, rate, args.warmup_s, timeout_s=args.timeout_s)
            measure = functools.partial(window, servers, args, requests, load, rate)
            loads.append(judge_load(args, load, rate, *take_turns(("shadow", "none"), args.rounds, measure)))
    return {
        "capacity": capacity,
        "shadow_fraction": args.shadow_fraction,
        "loads": loads,
        "passed": all(x["passed"] for x in loads),
    }


def judge_load(
    args: argparse.Namespace, load: float, rate: float, windows: list[dict[str, Any]], ok_s: dict[str, list[float]]
) -> dict[str, Any]:
    pooled: dict[str, dict[str, Any]] = {}
    for side, ok in ok_s.items():
        count = sum(w["count"] for w in windows if w["side"] == side)
        pooled[side] = {"count": count, "ok": len(ok), "errors": count - len(ok), **quantiles(ok)}
    shadow = [w for w in windows if w["side"] == "shadow"]
    figures = {
        "load": load,
        "rate": rate,
        "shadow": pooled["shadow"],
        "none": pooled["none"],
        "p50_ratio": pooled["shadow"]["p50_ms"] / pooled["none"]["p50_ms"],
        "p99_ratio": pooled["shadow"]["p99_ms"] / pooled["none"]["p99_ms"],
        "shadow_samples": sum(w["samples"] for w in shadow),
        "shed": sum(w["shed"] for w in shadow),
        "rollout_state": shadow[-1]["state"] if shadow else None,
        "windows": windows,
    }
    if load == args.high_load:  # the issue: at 95%, live p99 within 10%; at 60%, p50 and p99 within 5%
        figures["p99_passed"] = figures["p99_ratio"] <= args.max_p99_ratio
    else:
        figures["p99_passed"] = max(figures["p50_ratio"], figures["p99_ratio"]) <= args.max_ratio
    figures["errors_passed"] = pooled["shadow"]["errors"] == 0 and pooled["none"]["errors"] == 0
    figures["shed_passed"] = figures["shed"] > 0 if load == args.high_load else None
    figures["passed"] = figures["p99_passed"] and figures["errors_passed"] and figures["shed_passed"] is not False
    return figures


# ---- b: detection -------------------------------------------------------------------------------------------------
def trial(
    args: argparse.Namespace,
    work: Path,
    name: str,
    primary: Path,
    candidate: Path,
    rollout: dict[str, Any],
    done: Callable[[dict[str, Any]], bool],
    requests: list[Request],
) -> dict[str, Any]:
    """A server with ``candidate`` in a rollout beside ``primary``, sent the held-out stream at ``--detect-rate`` in
    one-second windows until ``done(status)``, the rollout decides, ``--detect-max-samples`` are compared or twice
    the time those take at that rate passes. The route is polled every ``--poll-s``."""
    repo = repository(args, work, name, {1: primary, 2: candidate}, rollout)
    records: list[Record] = []
    with start(repo, work / "logs" / f"{name}.log", args) as server:
        wait_state(server.url, args.model, ["running"])
        polls = poller(server.url, args.model, args.poll_s)
        began, offset, printed = time.perf_counter(), 0, 0.0
        budget_s = 2 * args.detect_max_samples / args.detect_rate + 10
        while time.perf_counter() - began < budget_s:
            latest = polls.latest({})
            if latest and (
                done(latest)
                or latest.get("state") != "running"
                or (comparison(latest).get("samples") or 0) >= args.detect_max_samples
            ):
                break
            turned = requests[offset % len(requests) :] + requests[: offset % len(requests)]
            records += open_loop(server.url, turned, args.detect_rate, 1.0, timeout_s=args.timeout_s)
            offset += int(args.detect_rate)
            if time.perf_counter() - printed >= 2.0:
                printed = time.perf_counter()
                now = compact(0.0, polls.latest({}))
                print(
                    f"  {name}: {now['samples']} samples, agreement {now['agreement']} [{now['agreement_low']}, "
                    f"{now['agreement_high']}], verdict {now['verdict']}, state {now['state']}",
                    flush=True,
                )
        history = [compact(t, s) for t, s in polls.finish()]
        final = polls.latest({})
    return {
        "rollout": rollout,
        "rate": args.detect_rate,
        "requests": latency(records),
        "history": history,
        "final": final,
        "poll_failures": dict(polls.failures),
    }


def first(history: list[dict[str, Any]], test: Callable[[dict[str, Any]], bool]) -> tuple[int | None, int | None]:
    """The samples at the first poll passing ``test``, and at the poll before it (the bracket polling leaves)."""
    for i, poll in enumerate(history):
        if test(poll):
            return poll["samples"], history[i - 1]["samples"] if i else 0
    return None, None


def reached(state: str) -> Callable[[dict[str, Any]], bool]:
    return lambda status: status.get("state") == state


def decided_at(history: list[dict[str, Any]], state: str) -> int | None:
    """The samples compared when the rollout reached ``state``: at the first poll in it, or, where the comparison is
    reset by the decision, the last poll before it."""
    at, before = first(history, lambda p: p["state"] == state)
    if at is None:
        return None
    return at if at else before


def detection(
    args: argparse.Namespace, work: Path, primary: Path, built: dict[str, Path], requests: list[Request]
) -> dict[str, Any]:
    low = args.min_agreement

    def excluding(poll: dict[str, Any]) -> bool:
        return poll.get("agreement_high") is not None and poll["agreement_high"] < low

    def seen_enough(status: dict[str, Any]) -> bool:  # past --detect-samples, and excluding 0.99 then
        return (comparison(status).get("samples") or 0) >= args.detect_samples and excluding(comparison(status))

    detect = trial(
        args, work, "detect", primary, built["detect"], shadow_rollout(args, 1.0, auto=False), seen_enough, requests
    )
    history = detect["history"]
    excluded, before = first(history, excluding)
    stays = next((history[i]["samples"] for i in range(len(history)) if all(excluding(p) for p in history[i:])), None)
    detect |= {
        "excluded_at_samples": excluded,
        "poll_before_samples": before,
        "excluded_for_good_at_samples": stays,
        "passed": excluded is not None
        and excluded <= args.detect_max_samples
        and stays is not None
        and stays <= args.detect_max_samples,
    }
    decided: dict[str, dict[str, Any]] = {}
    for name, state in (("promote", "promoted"), ("permuted", "aborted")):
        rollout = shadow_rollout(args, 1.0, auto=True)
        decided[name] = trial(args, work, name, primary, built[name], rollout, reached(state), requests)
    promote, permuted = decided["promote"], decided["permuted"]
    promote |= {"promoted_at_samples": decided_at(promote["history"], "promoted")}
    promote["passed"] = promote["final"].get("state") == "promoted"
    at = decided_at(permuted["history"], "aborted")
    permuted |= {
        "aborted_at_samples": at,
        "passed": permuted["final"].get("state") == "aborted" and at is not None and at <= args.abort_within,
    }
    return {
        "detect": detect,
        "promote": promote,
        "permuted": permuted,
        "passed": detect["passed"] and promote["passed"] and permuted["passed"],
    }


# ---- c: promotion under load ----------------------------------------------------------------------------------------
def promotion(
    args: argparse.Namespace, work: Path, primary: Path, copy: Path, requests: list[Request], capacity: float
) -> dict[str, Any]:
    """An open loop at ``--load`` x capacity on a server shadowing a copy, promoted through the admin API at
    ``--promote-at`` of ``--promote-s``: every request must be answered 200."""
    repo = repository(
        args, work, "promotion", {1: primary, 2: copy}, shadow_rollout(args, args.shadow_fraction, auto=False)
    )
    rate, at_s = args.load * capacity, args.promote_s * args.promote_at
    call: dict[str, Any] = {}
    with start(repo, work / "logs" / "promotion.log", args) as server:
        wait_state(server.url, args.model, ["running"])

        def promote() -> None:
            began = time.perf_counter()
            reason = {"reason": "rollout_bench: promotion under load"}
            path = rollout_path(args.model) + "/promote"
            code, body = admin_post(server.url, path, args.admin_token, reason)
            call.update(status=code, body=body, took_ms=1000 * (time.perf_counter() - began))

        polls = poller(server.url, args.model, args.latency_poll_s)
        timer = threading.Timer(at_s, promote)
        timer.start()

        def tick(t: float) -> None:
            if round(t) % 5 == 0:
                print(f"  promotion run: {t:.0f} s", flush=True)

        records = open_loop(server.url, requests, rate, args.promote_s, timeout_s=args.timeout_s, on_tick=tick)
        timer.join()
        history = [compact(t, s) for t, s in polls.finish()]
        final = polls.latest({})
        versions = answered_versions(server.url, args.model, requests[:20])
    sent = int(rate * args.promote_s)
    failed = [r for r in records if r.outcome != "200"]
    near = [r.latency_s for r in records if r.outcome == "200" and abs(r.due_s - at_s) <= 1.0]
    figures = {
        "rate": rate,
        "duration_s": args.promote_s,
        "promote_at_s": at_s,
        "promote_call": call,
        "sent": sent,
        "recorded": len(records),
        "failed": len(failed),
        "lost": sent - len(records),
        "failures": dict(latency(failed)["outcomes"]),
        "latency": latency(records),
        "p99_ms_within_1s_of_promotion": ms(near, 0.99),
        "final_state": final.get("state"),
        "final_primary": final.get("primary"),
        "versions_after": versions,
        "history": history,
    }
    figures["passed"] = (
        call.get("status") == 200
        and not failed
        and len(records) == sent
        and final.get("state") == "promoted"
        and set(versions) == {"2"}
    )
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
