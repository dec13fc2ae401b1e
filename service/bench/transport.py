"""The transport alone: submit + answer round trips of one 224x224x3 uint8 image through the real shared-memory
arenas and messages, between sender processes (the front ends' client end) and one engine process (the engine's
end, answering each Submit at once with ten logits: no batcher, no model).

    visionserve bench transport --senders 1,4 --inflight 1,4 --seconds 5

Prints, per configuration, round trips per second (all senders together) and the round trip's median and p99 in
microseconds. Each sender copies the image into its arena for every request, as a front end does.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing as mp
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.runner import on_fresh_loop
from service.bench.kit import Flag, ms
from service.core.arguments import comma_ints
from service.transport import shm
from service.transport.client import EngineClient
from service.transport.messages import Catalog, Result, Snapshot, Submit, Tensor
from service.transport.server import EngineEndpoint

CLASSES = 10
SHAPE = (1, 3, 224, 224)


class _Echo:
    """Answers every Submit at once (reads one byte of the image, so the region is really touched)."""

    def __init__(self, endpoint: EngineEndpoint) -> None:
        self.endpoint = endpoint
        self.outputs = [Tensor.of("logits", np.zeros((1, CLASSES), dtype=np.float32))]

    def submit(self, peer: bytes, message: Submit, images: np.ndarray) -> None:
        _ = images[0, 0, 0, 0]
        self.endpoint.send(peer, Result(message.id, self.outputs, None, 0.0, 0.0, [1]))

    def cancel(self, peer: bytes, request: int) -> None:
        pass

    async def query(self, peer: bytes, call: Any) -> Any:  # every query: the catalog is all a sender asks
        return Catalog([], {}, {}, 1)

    def catalog_version(self) -> int:
        return 1


def _engine(address: str, stop: Any) -> None:
    async def main() -> None:
        endpoint = EngineEndpoint(address, "bench")
        await endpoint.start(_Echo(endpoint))
        while not stop.is_set():
            await asyncio.sleep(0.1)
        await endpoint.close()

    on_fresh_loop(main())


def _sender(address: str, arena_name: str, index: int, inflight: int, seconds: float, out: Any) -> None:
    async def main() -> None:
        arena = shm.Arena(arena_name)
        client = EngineClient(
            address, arena, f"s{index}", snapshot=lambda t: Snapshot(t, [], []), on_change=lambda: None
        )
        await client.start()
        while not client.up:
            await asyncio.sleep(0.01)
        image = np.random.default_rng(index).integers(0, 256, SHAPE, dtype=np.uint8)
        latencies: list[float] = []
        deadline = time.perf_counter() + seconds

        async def loop() -> None:
            while time.perf_counter() < deadline:
                started = time.perf_counter()  # submit copies the image into the arena, as a front end's does
                await client.submit("m", 1, image, timeout_ms=None, priority=0, request_id="", guard_s=10.0)
                latencies.append(time.perf_counter() - started)

        began = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(inflight)))
        out.put((len(latencies) / (time.perf_counter() - began), latencies))
        await client.close()
        arena.close()

    on_fresh_loop(main())


def measure(senders: int, inflight: int, seconds: float) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    folder = Path(tempfile.mkdtemp(prefix="vs-bench-"))
    address = f"ipc://{folder}/engine"
    stop = ctx.Event()
    engine = ctx.Process(target=_engine, args=(address, stop))
    engine.start()
    names = [shm.new_name(f"bench{i}") for i in range(senders)]
    for name in names:
        shm.create(name, 8 << 20).close()
    out = ctx.Queue()
    procs = [ctx.Process(target=_sender, args=(address, names[i], i, inflight, seconds, out)) for i in range(senders)]
    try:
        for p in procs:
            p.start()
        results = [out.get(timeout=seconds + 60) for _ in procs]
        for p in procs:
            p.join()
    finally:
        stop.set()
        engine.join(10)
        for name in names:
            shm.unlink(name)
    latencies = [s for r in results for s in r[1]]
    row = {"senders": senders, "inflight_per_sender": inflight, "round_trips_per_s": float(sum(r[0] for r in results))}
    return row | {"median_us": 1000 * ms(latencies, 0.5), "p99_us": 1000 * ms(latencies, 0.99)}


FLAGS: list[Flag] = [
    ("--senders", (1, 4), "sender processes", comma_ints),
    ("--inflight", (1, 4), "requests in flight per sender", comma_ints),
    ("--seconds", 5.0, "measuring time per configuration"),
    ("--json", False, "print JSON lines (off: a table)"),
]


def main(args: argparse.Namespace) -> int:
    print(f"transport round trips, one {'x'.join(map(str, SHAPE[1:]))} uint8 image each, {os.cpu_count()} cores")
    for senders, inflight in itertools.product(args.senders, args.inflight):
        row = measure(senders, inflight, args.seconds)
        if args.json:
            print(json.dumps(row))
        else:
            print(
                f"  senders {senders:>2} x in flight {inflight:>2}: {row['round_trips_per_s']:9.0f} round trips/s, "
                f"median {row['median_us']:7.1f} us, p99 {row['p99_us']:7.1f} us"
            )
    return 0
