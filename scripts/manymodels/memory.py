"""Reading a server: the residency gauges, the charged bytes of ``GET /v1/models``, the engine's RSS, and a
thread sampling them while the traffic runs."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from service import launcher


def residency(url: str) -> dict[str, Any]:
    """The residency gauges of ``/metrics``: charged bytes per model and per device, and the budget (CPU)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, Any] = {"models": {}, "device_bytes": 0.0, "budget_bytes": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "visionserve_model_resident_bytes" and s.value > 0:
                out["models"][s.labels["model"]] = s.value
            elif s.name == "visionserve_device_resident_bytes" and s.labels.get("device") == "cpu":
                out["device_bytes"] = s.value
            elif s.name == "visionserve_memory_budget_bytes" and s.labels.get("device") == "cpu":
                out["budget_bytes"] = s.value
    return out


def rss_bytes(pid: int) -> int:
    """Resident bytes of one process (``/proc/PID/statm``, as the engine measures itself); 0 once it is gone."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def engine_pid(server: launcher.RunningServer) -> int:
    engines = server.roles()["engine"]
    if len(engines) != 1:
        raise RuntimeError(f"expected one engine process under {server.process.pid}, found {engines}")
    return engines[0]


def listed(url: str) -> dict[str, float]:
    """The charged bytes of each resident model as ``GET /v1/models`` lists them (the front end's catalog)."""
    rows = httpx.get(url + "/v1/models", timeout=10).json()
    return {r["name"]: float(r["resident_bytes"]) for r in rows if r.get("resident")}


class Scraper(threading.Thread):
    """The charged bytes and the engine's RSS every ``period_s`` while the traffic runs, read from ``/v1/models``
    (``source="models"``) or ``/metrics``, with how long each read took."""

    def __init__(self, server: launcher.RunningServer, pid: int, period_s: float, source: str) -> None:
        super().__init__(name="scraper", daemon=True)
        self.server, self.pid, self.period_s, self.source = server, pid, period_s, source
        self.samples: list[dict[str, Any]] = []
        self.engines_seen: set[int] = {pid}
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(self.period_s):
            with contextlib.suppress(httpx.HTTPError, ValueError):
                began = time.perf_counter()
                if self.source == "metrics":
                    seen = residency(self.server.url)
                    charged, resident = seen["device_bytes"], len(seen["models"])
                else:
                    models = listed(self.server.url)
                    charged, resident = sum(models.values()), len(models)
                took = time.perf_counter() - began
                self.samples.append({"charged": charged, "resident": resident, "rss": rss_bytes(self.pid),
                                     "read_ms": 1000 * took})  # fmt: skip
            self.engines_seen.update(self.server.roles()["engine"])

    def finish(self) -> list[dict[str, Any]]:
        self.halt.set()
        self.join()
        return self.samples
