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
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from loadtest.inputs import model_path
from loadtest.openloop import Record, Request
from service import launcher
from service.bench import kit


@contextlib.contextmanager
def serve(
    args: argparse.Namespace, work: Path, name: str, versions: dict[int, Path], rollout: dict[str, Any] | None = None
) -> Iterator[launcher.RunningServer]:
    """A server, ready, with the bench's workers and admin token, on a fresh repository ``WORK/repos/NAME`` of the
    model with ``versions``, ``--model-config`` and ``rollout`` (running before this yields), logging to
    ``WORK/logs/NAME.log``."""
    config = "".join(line + "\n" for line in args.model_config.splitlines()) + kit.config_toml(rollout=rollout)
    repo = kit.repository(work / "repos" / name, {args.model: (versions, config)})
    flags = ("--workers", str(args.workers), "--admin-token", args.admin_token)
    with launcher.start(repo, *flags, log=work / "logs" / f"{name}.log", ready_timeout_s=300) as server:
        if rollout is not None:
            wait_running(server.url, args.model)
        yield server


# ---- the rollout route ----------------------------------------------------------------------------------------------
def rollout_path(model: str) -> str:
    return f"/v2/models/{model}/rollout"


def status(url: str, model: str) -> dict[str, Any]:
    """``GET /v2/models/{model}/rollout``; RuntimeError naming the answer when it is not a 200."""
    answer = httpx.get(url + rollout_path(model), timeout=5.0)
    if answer.status_code != 200:
        raise RuntimeError(f"GET {rollout_path(model)} answered {answer.status_code}: {answer.text[:300]}")
    return answer.json()


def wait_running(url: str, model: str, timeout_s: float = 60.0) -> None:
    """Until the rollout is running; RuntimeError with its last status otherwise."""
    deadline = time.monotonic() + timeout_s
    current: dict[str, Any] = {}
    while time.monotonic() < deadline:
        current = status(url, model)
        if current.get("state") == "running":
            return
        time.sleep(0.1)
    raise RuntimeError(f"the rollout of {model} at {url} was not running in {timeout_s:g} s: {current}")


def comparison(state: dict[str, Any]) -> dict[str, Any]:
    return state.get("comparison") or {}


def requests_for(model: str, pngs: Sequence[bytes]) -> list[Request]:
    """One classify request per image, naming no version (only those take part in a rollout)."""
    path = model_path("image", model)
    return [Request(path, png, {"content-type": "image/png"}, "digit") for png in pngs]


def poller(url: str, model: str, interval_s: float) -> kit.Sampler[dict[str, Any]]:
    """``GET /v2/models/{m}/rollout`` every ``interval_s`` on a thread of its own, started."""
    polls = kit.Sampler(lambda: status(url, model), interval_s, (httpx.HTTPError, RuntimeError, ValueError))
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
    polled = {"t_s": round(seconds, 3), "state": state.get("state"), "verdict": state.get("verdict")}
    return polled | {k: found.get(k) for k in KEPT}


def shadow_rollout(args: argparse.Namespace, fraction: float, auto: bool) -> dict[str, Any]:
    limits = {"min_agreement": args.min_agreement, "min_samples": args.min_samples}
    return {"candidate": 2, "mode": "shadow", "fraction": fraction, "auto": auto, **limits}


# ---- a: live latency with and without a shadow ----------------------------------------------------------------------
def window(servers: dict[str, Any], args: argparse.Namespace, requests: list[Request], load: float, rate: float,
           side: str, k: int) -> tuple[dict[str, Any], list[float]]:  # fmt: skip
    """Round ``k``'s open-loop window on ``side`` at ``rate`` (``load`` x capacity), the rollout route polled through
    it; its figures and latencies."""
    url = servers[side].url
    before = status(url, args.model)
    polls = poller(url, args.model, args.latency_poll_s)
    records = kit.open_loop(url, requests, rate, args.window_s, timeout_s=args.timeout_s)
    after = polls.finish()[-1][1]
    moved = {k: (comparison(after).get(k) or 0) - (comparison(before).get(k) or 0) for k in ("samples", "shed")}
    done = {**kit.latency(records), "state": after.get("state"), **moved}
    print(
        f"  {load:.0%} of capacity ({rate:.0f} req/s), round {k}, {side:<6}: {done['ok']}/{done['count']} ok, p50 "
        f"{done['p50_ms']:.2f} ms, p99 {done['p99_ms']:.2f} ms"
        + (f", shadow samples {done['samples']}, shed {done['shed']}" if side == "shadow" else ""),
    )
    return done, kit.ok_seconds(records)


def latency_runs(
    args: argparse.Namespace, work: Path, primary: Path, copy: Path, requests: list[Request], capacity: float
) -> dict[str, Any]:
    """A server with a shadow of a copy of the primary (``--shadow-fraction``, auto off: it never decides) and one
    without, both up throughout, taking turns (AB, BA, ...) at each load; p50/p99 pooled per side and load."""
    loads: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        rollout = shadow_rollout(args, args.shadow_fraction, auto=False)
        servers = {
            "shadow": stack.enter_context(serve(args, work, "shadow", {1: primary, 2: copy}, rollout)),
            "none": stack.enter_context(serve(args, work, "plain", {1: primary})),
        }
        for load in (args.load, args.high_load):
            rate = load * capacity
            for server in servers.values():  # not counted: connections, the first batches
                kit.open_loop(server.url, requests, rate, args.warmup_s, timeout_s=args.timeout_s)
            measure = functools.partial(window, servers, args, requests, load, rate)
            loads.append(judge_load(args, load, rate, *kit.take_turns(("shadow", "none"), args.rounds, measure)))
    passed = all(x["passed"] for x in loads)
    return {"capacity": capacity, "shadow_fraction": args.shadow_fraction, "loads": loads, "passed": passed}


def judge_load(
    args: argparse.Namespace, load: float, rate: float, windows: list[dict[str, Any]], ok_s: dict[str, list[float]]
) -> dict[str, Any]:
    pooled: dict[str, dict[str, Any]] = {}
    for side, ok in ok_s.items():
        count = sum(w["count"] for w in windows if w["side"] == side)
        pooled[side] = {"count": count, "ok": len(ok), "errors": count - len(ok), **kit.quantiles(ok)}
    shadow, none = pooled["shadow"], pooled["none"]
    shadowed = [w for w in windows if w["side"] == "shadow"]
    p50_ratio, p99_ratio = shadow["p50_ms"] / none["p50_ms"], shadow["p99_ms"] / none["p99_ms"]
    shed, high = sum(w["shed"] for w in shadowed), load == args.high_load
    figures = {
        "load": load,
        "rate": rate,
        "shadow": shadow,
        "none": none,
        "p50_ratio": p50_ratio,
        "p99_ratio": p99_ratio,
        "shadow_samples": sum(w["samples"] for w in shadowed),
        "shed": shed,
        "rollout_state": shadowed[-1]["state"] if shadowed else None,
        "windows": windows,
        # the issue: at 95%, live p99 within 10%; at 60%, p50 and p99 within 5%
        "p99_passed": p99_ratio <= args.max_p99_ratio if high else max(p50_ratio, p99_ratio) <= args.max_ratio,
        "errors_passed": shadow["errors"] == 0 and none["errors"] == 0,
        "shed_passed": shed > 0 if high else None,
    }
    figures["passed"] = figures["p99_passed"] and figures["errors_passed"] and figures["shed_passed"] is not False
    return figures


# ---- b: detection -------------------------------------------------------------------------------------------------
Test = Callable[[dict[str, Any]], bool]


def trial(args: argparse.Namespace, url: str, requests: list[Request], name: str, done: Test) -> dict[str, Any]:
    """The held-out stream sent to the server at ``url`` at ``--detect-rate`` in one-second windows until
    ``done(status)``, the rollout decides, ``--detect-max-samples`` are compared or twice the time those take at that
    rate passes. The route is polled every ``--poll-s``."""
    records: list[Record] = []
    polls = poller(url, args.model, args.poll_s)
    began, offset, printed = time.perf_counter(), 0, 0.0
    budget_s = 2 * args.detect_max_samples / args.detect_rate + 10
    while time.perf_counter() - began < budget_s:
        latest = polls.latest({})
        enough = (comparison(latest).get("samples") or 0) >= args.detect_max_samples
        if latest and (done(latest) or latest.get("state") != "running" or enough):
            break
        turned = requests[offset % len(requests) :] + requests[: offset % len(requests)]
        records += kit.open_loop(url, turned, args.detect_rate, 1.0, timeout_s=args.timeout_s)
        offset += int(args.detect_rate)
        if time.perf_counter() - printed >= 2.0:
            printed = time.perf_counter()
            now = compact(0.0, polls.latest({}))
            print(
                f"  {name}: {now['samples']} samples, agreement {now['agreement']} [{now['agreement_low']}, "
                f"{now['agreement_high']}], verdict {now['verdict']}, state {now['state']}",
            )
    history = [compact(t, s) for t, s in polls.finish()]
    figures = {"rate": args.detect_rate, "requests": kit.latency(records), "history": history}
    return figures | {"final": polls.latest({}), "poll_failures": dict(polls.failures)}


def first(history: list[dict[str, Any]], test: Test) -> tuple[int | None, int | None]:
    """The samples at the first poll passing ``test``, and at the poll before it (the bracket polling leaves)."""
    for i, poll in enumerate(history):
        if test(poll):
            return poll["samples"], history[i - 1]["samples"] if i else 0
    return None, None


def decided_at(history: list[dict[str, Any]], state: str) -> int | None:
    """The samples compared when the rollout reached ``state``: at the first poll in it, or, where the comparison is
    reset by the decision, the last poll before it."""
    at, before = first(history, lambda p: p["state"] == state)
    return at or before  # None when it never did


def detection(
    args: argparse.Namespace, work: Path, primary: Path, built: dict[str, Path], requests: list[Request]
) -> dict[str, Any]:
    low = args.min_agreement

    def excluding(poll: dict[str, Any]) -> bool:
        return poll.get("agreement_high") is not None and poll["agreement_high"] < low

    def seen_enough(status: dict[str, Any]) -> bool:  # past --detect-samples, and excluding 0.99 then
        return (comparison(status).get("samples") or 0) >= args.detect_samples and excluding(comparison(status))

    def run(name: str, auto: bool, done: Test) -> dict[str, Any]:
        """A server with ``built[name]`` in a shadow of every request (``auto``: it decides), in a trial."""
        rollout = shadow_rollout(args, 1.0, auto)
        with serve(args, work, name, {1: primary, 2: built[name]}, rollout) as server:
            return {"rollout": rollout} | trial(args, server.url, requests, name, done)

    detect = run("detect", False, seen_enough)
    history = detect["history"]
    excluded, before = first(history, excluding)
    stays = next((history[i]["samples"] for i in range(len(history)) if all(excluding(p) for p in history[i:])), None)
    detect |= {
        "excluded_at_samples": excluded,
        "poll_before_samples": before,
        "excluded_for_good_at_samples": stays,
        "passed": excluded is not None and stays is not None and max(excluded, stays) <= args.detect_max_samples,
    }
    promote = run("promote", True, lambda status: status.get("state") == "promoted")
    permuted = run("permuted", True, lambda status: status.get("state") == "aborted")
    promote |= {"promoted_at_samples": decided_at(promote["history"], "promoted")}
    promote["passed"] = promote["final"].get("state") == "promoted"
    at = decided_at(permuted["history"], "aborted")
    permuted |= {
        "aborted_at_samples": at,
        "passed": permuted["final"].get("state") == "aborted" and at is not None and at <= args.abort_within,
    }
    passed = detect["passed"] and promote["passed"] and permuted["passed"]
    return {"detect": detect, "promote": promote, "permuted": permuted, "passed": passed}


# ---- c: promotion under load ----------------------------------------------------------------------------------------
def promotion(
    args: argparse.Namespace, work: Path, primary: Path, copy: Path, requests: list[Request], capacity: float
) -> dict[str, Any]:
    """An open loop at ``--load`` x capacity on a server shadowing a copy, promoted through the admin API at
    ``--promote-at`` of ``--promote-s``: every request must be answered 200."""
    rate, at_s = args.load * capacity, args.promote_s * args.promote_at
    call: dict[str, Any] = {}
    rollout = shadow_rollout(args, args.shadow_fraction, auto=False)
    with serve(args, work, "promotion", {1: primary, 2: copy}, rollout) as server:

        def promote() -> None:
            began = time.perf_counter()
            answer = httpx.post(
                server.url + rollout_path(args.model) + "/promote",
                json={"reason": "rollout_bench: promotion under load"},
                headers={"Authorization": f"Bearer {args.admin_token}"},
                timeout=30.0,
            )
            body: Any = answer.text
            with contextlib.suppress(ValueError):
                body = answer.json()
            call.update(status=answer.status_code, body=body, took_ms=1000 * (time.perf_counter() - began))

        polls = poller(server.url, args.model, args.latency_poll_s)
        timer = threading.Timer(at_s, promote)
        timer.start()

        def tick(t: float) -> None:
            if round(t) % 5 == 0:
                print(f"  promotion run: {t:.0f} s")

        records = kit.open_loop(server.url, requests, rate, args.promote_s, timeout_s=args.timeout_s, on_tick=tick)
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
        "failures": dict(kit.latency(failed)["outcomes"]),
        "latency": kit.latency(records),
        "p99_ms_within_1s_of_promotion": kit.ms(near, 0.99),
        "final_state": final.get("state"),
        "final_primary": final.get("primary"),
        "versions_after": versions,
        "history": history,
    }
    promoted = final.get("state") == "promoted" and set(versions) == {"2"}
    figures["passed"] = call.get("status") == 200 and not failed and len(records) == sent and promoted
    return figures


def answered_versions(url: str, model: str, requests: list[Request]) -> dict[str, int]:
    """Which versions answer requests naming none (``version`` of the classify answer), counted."""
    with httpx.Client(base_url=url, timeout=30) as client:
        answers = [client.post(r.path, content=r.body, headers=r.headers) for r in requests]
    ok = [str(a.json().get("version")) if a.status_code == 200 else f"HTTP {a.status_code}" for a in answers]
    return dict(Counter(ok))
