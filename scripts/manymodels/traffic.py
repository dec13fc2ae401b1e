"""The traffic: a seeded open-loop sequence, sent by a pool of threads with every answer's label and cold start,
and the ideal LRU replayed on it."""

from __future__ import annotations

import argparse
import math
import random
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from loadtest.mix import ModelDraw, cold_start_ms, draw_seed, make_mix


@dataclass
class Answer:
    model: str
    due_s: float
    latency_s: float
    outcome: str  # the status code, or the exception's class name
    label: str | None
    cold_ms: float | None  # Server-Timing's cold_start; None: the model was resident
    timing: str = ""  # the whole Server-Timing header


def make_sequence(names: Sequence[str], args: argparse.Namespace) -> list[tuple[float, str]]:
    """(due second, model) for ``--duration-s`` of Poisson arrivals at ``--rate``; models drawn as the load tester
    draws them (``loadtest.mix``: the same seed gives the same models)."""
    draw = ModelDraw(make_mix(names, args.popularity).cumulative, draw_seed(args.seed, 0))
    arrivals = random.Random(args.seed)
    out: list[tuple[float, str]] = []
    t = 0.0
    while True:
        t += arrivals.expovariate(args.rate)
        if t >= args.duration_s:
            return out
        out.append((t, names[draw.next()]))


def drive(url: str, sequence: Sequence[tuple[float, str]], body: bytes, args: argparse.Namespace) -> list[Answer]:
    """Send each request at its moment from a pool of ``--clients`` threads; every answer's label and cold start."""
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    headers = {"Content-Type": "image/jpeg"}
    with httpx.Client(base_url=url, timeout=args.timeout_s, limits=limits) as client:

        def one(start: float, due: float, model: str) -> Answer:
            label, timing = None, ""
            try:
                r = client.post(f"/v1/models/{model}/classify?top_k=1", content=body, headers=headers)
                timing = r.headers.get("server-timing", "")
                outcome, cold = str(r.status_code), cold_start_ms(timing)
                if r.status_code == 200:
                    label = r.json()["results"][0]["predictions"][0]["label"]
            except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
                outcome, cold = type(exc).__name__, None
            return Answer(model, due, time.perf_counter() - start - due, outcome, label, cold, timing)

        with ThreadPoolExecutor(args.clients, thread_name_prefix="client") as pool:
            start = time.perf_counter()
            futures = []
            for due, model in sequence:
                delay = start + due - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                futures.append(pool.submit(one, start, due, model))
            return [f.result() for f in futures]


def ideal_lru(sequence: Sequence[str], capacity: int) -> float:
    """The hit rate of an LRU cache of ``capacity`` models on ``sequence`` (a miss loads at once, evicting the
    least recently used)."""
    cache: OrderedDict[str, None] = OrderedDict()
    hits = 0
    for model in sequence:
        if model in cache:
            hits += 1
            cache.move_to_end(model)
        else:
            cache[model] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits / len(sequence) if sequence else math.nan
