"""A closed-loop load generator over HTTP: N virtual clients, each sends, waits for the answer, sends again.

Bounded by a duration and a request count; a warm-up period is excluded from the numbers. This is the core the
full load tester (open loop, SLO search, plots) builds on.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from service.samples import photo_like_jpegs


def generated_jpegs(count: int = 32) -> list[bytes]:
    """Photo-like 500x375 JPEGs (the same generator the in-process bench uses)."""
    return photo_like_jpegs(count)


def read_images(folder: str | Path) -> list[bytes]:
    files = sorted(p for p in Path(folder).rglob("*") if p.suffix.lower() in (".jpg", ".jpeg", ".png", ".webp", ".bmp"))
    if not files:
        raise ValueError(f"{folder} holds no images")
    return [p.read_bytes() for p in files]


MEDIA = {b"\xff\xd8": "image/jpeg", b"\x89P": "image/png", b"RI": "image/webp", b"BM": "image/bmp"}


def media_type(data: bytes) -> str:
    return MEDIA.get(data[:2], "application/octet-stream")


@dataclass
class StepResult:
    concurrency: int
    duration_s: float
    requests: int
    images: int
    errors: dict[str, int] = field(default_factory=dict)
    latencies_ms: list[float] = field(default_factory=list)

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.duration_s if self.duration_s else 0.0

    @property
    def images_per_s(self) -> float:
        return self.images / self.duration_s if self.duration_s else 0.0

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else float("nan")

    def summary(self) -> dict[str, Any]:
        return {
            "concurrency": self.concurrency,
            "duration_s": self.duration_s,
            "requests": self.requests,
            "errors": self.errors,
            "requests_per_s": self.requests_per_s,
            "images_per_s": self.images_per_s,
            "latency_ms": {
                "p50": self.percentile(50), "p90": self.percentile(90), "p99": self.percentile(99),
                "max": max(self.latencies_ms, default=float("nan")),
                "mean": statistics.fmean(self.latencies_ms) if self.latencies_ms else float("nan"),
            },
        }  # fmt: skip


async def closed_loop(
    url: str,
    model: str,
    images: list[bytes],
    *,
    concurrency: int,
    duration_s: float,
    warmup_s: float = 2.0,
    max_requests: int = 1_000_000,
    path: str = "/v1/models/{model}/classify?top_k=1",
) -> StepResult:
    """Run ``concurrency`` clients for ``warmup_s + duration_s`` (or until ``max_requests``)."""
    target = path.format(model=model)
    result = StepResult(concurrency, 0.0, 0, 0)
    errors: Counter[str] = Counter()
    started = time.perf_counter()
    measure_from = started + warmup_s
    stop_at = measure_from + duration_s
    sent = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

        async def client_loop(k: int) -> None:
            nonlocal sent
            i = k
            while time.perf_counter() < stop_at and sent < max_requests:
                sent += 1
                data = images[i % len(images)]
                i += concurrency
                t0 = time.perf_counter()
                try:
                    r = await client.post(target, content=data, headers={"content-type": media_type(data)})
                    outcome = str(r.status_code)
                except httpx.TimeoutException:
                    outcome = "timeout"
                except httpx.TransportError:
                    outcome = "connection"
                t1 = time.perf_counter()
                if t0 < measure_from or t1 > stop_at:
                    continue
                if outcome == "200":
                    result.requests += 1
                    result.images += 1
                    result.latencies_ms.append((t1 - t0) * 1000)
                else:
                    errors[outcome] += 1

        await asyncio.gather(*(client_loop(k) for k in range(concurrency)))
    result.duration_s = max(0.0, min(time.perf_counter(), stop_at) - measure_from)
    result.errors = dict(errors)
    return result
