"""The server as processes: a supervisor, one engine, several front ends. Real processes, real HTTP, real kills.

Every load here is bounded in count and time; every wait has a deadline.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.launcher import roles as children
from tests.conftest import encode_image, random_image
from tests.http.conftest import RunningServer, free_port, start_server, stop_server

pytestmark = pytest.mark.slow

IMAGE = encode_image(random_image(28, 28), "PNG")


# An engine takes this long to load digits, by its config: a restarted engine is not ready for at least this long
# on any machine, so the tests see the window in which front ends must answer 503 (a digits engine restarts in
# well under a second on a fast machine otherwise).
LOAD_DELAY_MS = 1500


@pytest.fixture
def repo(served_repo: Path, tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    shutil.copytree(served_repo / "digits", root / "digits")
    config = root / "digits" / "config.toml"
    config.write_text(config.read_text() + f"\n[faults]\nload_delay_ms = {LOAD_DELAY_MS}\n")
    return root


def running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def segments(pid: int) -> set[str]:
    return {p.name for p in Path("/dev/shm").glob(f"visionserve-{pid}-*")}


def wait_for(check: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout_s} s")


def ready(server: RunningServer) -> bool:
    try:
        return httpx.get(server.url + "/v2/health/ready", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


class Load:
    """Closed-loop clients on fresh connections (so the kernel spreads them over the front ends), recording each
    answer's status (-1: a transport error) and how long it took. Bounded by ``max_requests`` and ``stop()``."""

    def __init__(self, server: RunningServer, clients: int = 4, max_requests: int = 100_000) -> None:
        self.url = server.url + "/v1/models/digits/classify"
        self.results: list[tuple[float, int, float]] = []  # (sent at, status, seconds)
        self._stop = threading.Event()
        self._max = max_requests
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)

    def _run(self) -> None:
        while not self._stop.is_set() and len(self.results) < self._max:
            sent = time.monotonic()
            try:
                with httpx.Client(timeout=20) as client:
                    status = client.post(self.url, content=IMAGE, headers={"content-type": "image/png"}).status_code
            except httpx.TransportError:
                status = -1
            with self._lock:
                self.results.append((sent, status, time.monotonic() - sent))

    def between(self, start: float, end: float) -> list[tuple[float, int, float]]:
        with self._lock:
            return [r for r in self.results if start <= r[0] < end]


@pytest.fixture
def server(repo: Path, tmp_path: Path) -> Iterator[RunningServer]:
    running = start_server(repo, tmp_path / "server.log", "--workers", "2", "--drain-timeout-s", "10")
    yield running
    stop_server(running)


def test_a_killed_front_end_is_restarted_while_the_other_keeps_serving(server: RunningServer) -> None:
    pid = server.process.pid
    before = children(pid)
    assert len(before["frontend"]) == 2 and len(before["engine"]) == 1
    arenas = segments(pid)
    assert len(arenas) == 2  # one arena per front end
    with Load(server) as load:
        time.sleep(1.0)
        killed_at = time.monotonic()
        os.kill(before["frontend"][0], signal.SIGKILL)
        time.sleep(3.0)
        wait_for(lambda: len(children(pid)["frontend"]) == 2, 30, "the supervisor restarts the front end")
        after_kill = load.between(killed_at, time.monotonic())
    codes = Counter(status for _, status, _ in after_kill)
    assert codes[200] > 0, codes  # the other front end kept answering
    assert set(codes) <= {200, -1}, codes  # nothing but the killed process's own connections failed
    assert codes[-1] <= 4, codes  # at most the requests in flight on it (4 clients)
    now = children(pid)["frontend"]
    assert before["frontend"][0] not in now
    fresh = segments(pid)
    assert len(fresh) == 2 and len(fresh - arenas) == 1  # the dead one's arena replaced, not leaked
    assert ready(server)


def test_a_killed_engine_means_503_at_once_then_recovery(server: RunningServer) -> None:
    pid = server.process.pid
    engine = children(pid)["engine"][0]
    with Load(server) as load:
        time.sleep(1.0)
        killed_at = time.monotonic()
        os.kill(engine, signal.SIGKILL)
        wait_for(lambda: not ready(server), 5, "readiness turns false")
        wait_for(lambda: ready(server), 90, "the restarted engine is ready again")
        back_at = time.monotonic()
        time.sleep(1.0)
        load.stop()
    during = load.between(killed_at + 0.2, back_at - 0.5)
    codes = Counter(status for _, status, _ in during)
    assert codes[503] > 0, codes  # refused, not left hanging
    assert set(codes) <= {200, 503}, codes
    slowest_refusal = max(seconds for _, status, seconds in during if status == 503)
    assert slowest_refusal < 2.0  # at once, nowhere near the client's 20 s timeout
    after = Counter(status for _, status, _ in load.between(back_at, back_at + 1.0))
    assert after[200] > 0, after
    assert children(pid)["engine"] != [engine]


def test_metrics_and_stats_from_any_front_end_count_every_request_once(server: RunningServer) -> None:
    n = 40
    for _ in range(n):
        with httpx.Client(base_url=server.url, timeout=20) as client:  # a new connection each: both front ends
            r = client.post("/v1/models/digits/classify", content=IMAGE, headers={"content-type": "image/png"})
            assert r.status_code == 200
    for _ in range(6):  # each scrape on its own connection, so either front end may answer
        with httpx.Client(base_url=server.url, timeout=20) as client:
            text = client.get("/metrics").text
            stats = client.get("/v2/models/digits/stats").json()["model_stats"][0]
        totals: Counter[str] = Counter()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.labels.get("model") != "digits":
                    continue
                if sample.name == "visionserve_requests_total" and sample.labels["outcome"] == "success":
                    totals["requests"] += int(sample.value)
                elif sample.name in ("visionserve_images_total", "visionserve_request_duration_seconds_count"):
                    totals[sample.name] += int(sample.value)
        assert totals == {"requests": n, "visionserve_images_total": n,
                          "visionserve_request_duration_seconds_count": n}  # fmt: skip
        assert stats["inference_stats"]["success"]["count"] == n
        assert stats["inference_count"] == n
        assert sum(b["compute_infer"]["count"] * b["batch_size"] for b in stats["batch_stats"]) == n


def test_sigterm_under_load_answers_everything_accepted_and_leaves_no_shared_memory(repo: Path, tmp_path: Path) -> None:
    server = start_server(repo, tmp_path / "server.log", "--workers", "2", "--drain-timeout-s", "10")
    pid = server.process.pid
    assert len(segments(pid)) == 2
    with Load(server, clients=6) as load:
        time.sleep(1.5)
        server.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        assert server.process.wait(30) == 0
        took = time.monotonic() - signalled
        load.stop()
    codes = Counter(status for _, status, _ in load.results)
    assert codes[200] > 0
    # 200: computed; 503: refused while draining; -1: the socket no longer accepted. Never a 500 or a hang.
    assert set(codes) <= {200, 503, -1}, codes
    assert took < 20
    assert segments(pid) == set()  # every arena unlinked
    assert children(pid) == {"engine": [], "frontend": []}
    assert "Traceback" not in (tmp_path / "server.log").read_text()


def test_killed_children_leave_no_shared_memory_after_the_supervisor_stops(repo: Path, tmp_path: Path) -> None:
    server = start_server(repo, tmp_path / "server.log", "--workers", "2")
    pid = server.process.pid
    for child in children(pid)["frontend"] + children(pid)["engine"]:
        os.kill(child, signal.SIGKILL)
    wait_for(lambda: len(children(pid)["frontend"]) == 2 and len(children(pid)["engine"]) == 1, 30, "restarts")
    wait_for(lambda: ready(server), 90, "ready again")
    assert len(segments(pid)) == 2  # the killed front ends' arenas were unlinked, not left behind
    assert stop_server(server) == 0
    assert segments(pid) == set()


def test_a_killed_process_group_leaves_no_shared_memory(repo: Path, tmp_path: Path) -> None:
    """SIGKILL to the supervisor's whole group (as a container runtime may do): nothing runs its exit path, and
    still no segment and no child outlives it."""
    port = free_port()
    cmd = [sys.executable, "-m", "service.cli", "serve", "--repository", str(repo), "--host", "127.0.0.1",
           "--port", str(port), "--grpc-port", "0", "--workers", "2"]  # fmt: skip
    with open(tmp_path / "server.log", "wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = RunningServer(f"http://127.0.0.1:{port}", process, tmp_path / "server.log")
    try:
        wait_for(lambda: ready(server), 120, "ready")
        assert len(segments(process.pid)) == 2
        kids = children(process.pid)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)
        wait_for(lambda: segments(process.pid) == set(), 15, "the segments are unlinked")
        wait_for(lambda: not [p for p in kids["engine"] + kids["frontend"] if running(p)], 30, "the children exit")
    finally:
        if process.poll() is None:
            process.kill()
