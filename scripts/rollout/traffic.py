"""Talking to the servers under test: their repositories, starting them, the rollout route polled on a thread of its
own, the admin calls, the open loop (the load tester's, keeping every request's record) and the closed-loop
capacity."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from loadtest.inputs import model_path, payloads
from loadtest.openloop import Record, Request, percentile, run_open_loop
from loadtest.pool import WorkerPool
from loadtest.step import StepBounds, StepSpec, run_step
from service import launcher


# ---- repositories and servers -------------------------------------------------------------------------------------
def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))  # a TOML basic string: JSON's escapes are TOML's


def repository(root: Path, model: str, versions: dict[int, Path], rollout: dict[str, Any] | None = None,
               config: str = "") -> Path:  # fmt: skip
    """A fresh repository at ``root`` holding ``model`` with ``versions`` (number -> a version folder, hard-linked)
    and a config.toml of ``config`` (serving settings, TOML) and, with ``rollout``, a ``[rollout]`` table. Returns
    ``root``."""
    shutil.rmtree(root, ignore_errors=True)
    folder = root / model
    folder.mkdir(parents=True)
    for number, source in versions.items():
        shutil.copytree(source, folder / str(number), copy_function=os.link)
    lines = [*config.splitlines(), *(["[rollout]", *(f"{k} = {toml_value(v)}" for k, v in rollout.items())]
                                     if rollout else [])]  # fmt: skip
    (folder / "config.toml").write_text("".join(line + "\n" for line in lines))
    return root


def start(repo: Path, log: Path, args: Any) -> launcher.RunningServer:
    """A server on ``repo`` with the bench's workers and admin token, ready."""
    return launcher.start(repo, "--workers", str(args.workers), "--admin-token", args.admin_token, log=log,
                          ready_timeout_s=300)  # fmt: skip


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


def admin_post(url: str, path: str, token: str, body: dict[str, Any] | None = None,
               timeout_s: float = 30.0) -> tuple[int, dict[str, Any] | str]:  # fmt: skip
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


class Poller(threading.Thread):
    """``GET /v2/models/{m}/rollout`` every ``interval_s`` on a thread of its own (the event loop sends the load);
    keeps ``(seconds since start, status)`` for each answer."""

    def __init__(self, url: str, model: str, interval_s: float) -> None:
        super().__init__(name="rollout-poller", daemon=True)
        self.url, self.model, self.interval_s = url, model, interval_s
        self.started_s = time.perf_counter()
        self.samples: list[tuple[float, dict[str, Any]]] = []
        self.failures: Counter[str] = Counter()
        self.halt = threading.Event()

    def poll(self) -> None:
        try:
            self.samples.append((time.perf_counter() - self.started_s, status(self.url, self.model)))
        except (httpx.HTTPError, RuntimeError, ValueError) as exc:
            self.failures[type(exc).__name__] += 1

    def run(self) -> None:
        while not self.halt.is_set():
            self.poll()
            self.halt.wait(self.interval_s)

    def latest(self) -> dict[str, Any]:
        return self.samples[-1][1] if self.samples else {}

    def finish(self) -> list[tuple[float, dict[str, Any]]]:
        self.halt.set()
        self.join()
        self.poll()  # the figures at the end of the load
        return self.samples


def comparison(state: dict[str, Any]) -> dict[str, Any]:
    value: dict[str, Any] = state.get("comparison") or {}
    return value


# ---- load ---------------------------------------------------------------------------------------------------------
def requests_for(model: str, pngs: Sequence[bytes]) -> list[Request]:
    """One classify request per image, naming no version (only those take part in a rollout)."""
    path = model_path("image", model)
    return [Request(path, png, {"content-type": "image/png"}, "digit") for png in pngs]


def open_loop(url: str, requests: Sequence[Request], rate: float, duration_s: float, timeout_s: float,
              on_tick: Callable[[float], None] | None = None) -> list[Record]:  # fmt: skip
    """The load tester's open loop: ``requests`` in turn at a constant ``rate`` for ``duration_s``, every record."""
    return asyncio.run(run_open_loop(url, requests, rate=rate, duration_s=duration_s, timeout_s=timeout_s,
                                     on_tick=on_tick))  # fmt: skip


def latency(records: Sequence[Record]) -> dict[str, Any]:
    """Counts, outcomes and p50/p99 (ms, from each scheduled send) of the answered requests."""
    ok = [r.latency_s for r in records if r.outcome == "200"]
    return {"count": len(records), "ok": len(ok), "outcomes": dict(Counter(r.outcome for r in records)),
            "p50_ms": 1000 * percentile(ok, 0.5), "p99_ms": 1000 * percentile(ok, 0.99)}  # fmt: skip


def capacity(url: str, model: str, pngs: list[bytes], clients: int, duration_s: float,
             timeout_s: float) -> dict[str, Any]:  # fmt: skip
    """Closed-loop throughput: ``clients`` clients of the load tester (one process) for ``duration_s`` after 1 s not
    counted."""
    bounds = StepBounds(url=url, warmup_s=1.0, duration_s=duration_s, drain_s=5.0, timeout_s=timeout_s,
                        max_requests=10**8)  # fmt: skip
    with WorkerPool(1, payloads(model, pngs)) as pool:
        result = run_step(pool, StepSpec("closed", concurrency=clients), bounds, model)
    return {"requests_per_s": result.requests_per_s, "clients": clients, "duration_s": duration_s,
            "p50_ms": result.latency_ms(50), "p99_ms": result.latency_ms(99), "errors": result.errors,
            "client_limited": result.client_limited}  # fmt: skip
