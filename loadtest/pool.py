"""Worker processes for the load generator: each has its own event loop and runs its share of every step.

The processes start once per run (spawned, so nothing of the parent's state leaks in) and get the ready request
bodies once (one model's, or one list per model of a mix); a step sends each its plan through a pipe and reads
back its ``PartResult``. A shared counter per process feeds the parent's progress bar.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any, cast

from loadtest.inputs import Payload
from loadtest.runner import PartPlan, PartResult, on_fresh_loop, run_part_async


def _worker(conn: Connection, corpus: list[list[Payload]], tally: Any) -> None:
    conn.send("ready")
    while True:
        plan = conn.recv()
        if plan is None:
            return
        try:
            conn.send(on_fresh_loop(run_part_async(plan, corpus, tally)))
        except BaseException:  # the parent reports it; the worker must not die silently
            conn.send(RuntimeError(traceback.format_exc()))


def _corpus(payloads: Sequence[Payload] | Sequence[Sequence[Payload]]) -> list[list[Payload]]:
    if not payloads:
        raise ValueError("a load needs at least one request body")
    if isinstance(payloads[0], Payload):
        return [list(cast(Sequence[Payload], payloads))]
    return [list(p) for p in cast(Sequence[Sequence[Payload]], payloads)]


class WorkerPool:
    """``processes`` load-generating processes; ``run(plans)`` gives one plan to each and returns their results.
    ``payloads``: one model's request bodies, or one list per model of the plans' mix, in its order."""

    def __init__(self, processes: int, payloads: Sequence[Payload] | Sequence[Sequence[Payload]]) -> None:
        if processes < 1:
            raise ValueError(f"processes must be >= 1, got {processes}")
        corpus = _corpus(payloads)
        ctx = mp.get_context("spawn")
        self.tallies = [ctx.Value("q", 0, lock=False) for _ in range(processes)]
        self.conns: list[Connection] = []
        self.procs = []
        for tally in self.tallies:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(child, corpus, tally), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        for conn in self.conns:  # every worker imported and ready before any step's clock starts
            if not conn.poll(120) or conn.recv() != "ready":
                self.close()
                raise RuntimeError("a load-generating process did not start")

    def __len__(self) -> int:
        return len(self.conns)

    def completed(self) -> int:
        return sum(int(t.value) for t in self.tallies)

    def start(self, plans: list[PartPlan]) -> None:
        for conn, plan in zip(self.conns, plans, strict=True):
            conn.send(plan)

    def done(self, timeout_s: float = 0.0) -> bool:
        return all(conn.poll(timeout_s) for conn in self.conns)

    def results(self) -> list[PartResult]:
        out = []
        for conn in self.conns:
            r = conn.recv()
            if isinstance(r, BaseException):
                raise r
            out.append(r)
        return out

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):  # a worker that already died
                conn.send(None)
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
