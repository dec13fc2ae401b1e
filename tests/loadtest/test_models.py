"""``visionserve loadtest --models``: requests drawn over several models by popularity, reported per model with
their cold starts and the hit rate, and the sequence written for an offline cache replay.

Against a real server serving copies of the digits model, every one resident (so no cold start may be reported),
and, for the counting of cold starts the server does not send yet, a small stand-in that marks a response
``cold_start`` whenever its model differs from the previous request's (a cache of one model): its cold starts are
then known exactly from the sequence the load tester wrote.
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from loadtest.mix import ModelDraw, ModelTally, cold_start_ms, draw_seed, expand, make_mix, parse_popularity
from tests.conftest import copy_model
from tests.http.conftest import RunningServer, metric_value, start_server, stop_server

ZOO = ("zoo_a", "zoo_b", "zoo_c")
TOKEN = "loadtest-admin"
SHORT = ["--duration", "1", "--warmup", "0.3", "--drain", "5", "--no-progress", "--json"]


def loadtest(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "service.cli", "loadtest", "--url", url, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


def said(text: str) -> str:
    """``text`` on one line: rich wraps what it prints to the terminal's width."""
    return " ".join(text.split())


def report_of(run: subprocess.CompletedProcess[str]) -> dict:  # type: ignore[type-arg]
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)  # type: ignore[no-any-return]


def assert_models_sum_to_the_step(step: dict) -> None:  # type: ignore[type-arg]
    models = step["models"].values()
    assert sum(m["measured"] for m in models) == step["measured"]
    assert sum(m["requests"] for m in models) == step["requests"]
    errors: Counter[str] = Counter()
    for m in models:
        errors.update(m["errors"])
    assert dict(errors) == step["errors"]
    assert sum(m["answered"] for m in models) == step["answered"]
    assert sum(m["share"] for m in models) == pytest.approx(1.0)


# ---- the draw, the popularity and the Server-Timing entry, on their own ------------------------------------------


def test_a_cold_start_entry_in_server_timing_is_read_with_its_duration() -> None:
    assert cold_start_ms("queue;dur=0.1, cold_start;dur=12.5, total;dur=20.0") == 12.5
    assert cold_start_ms("cold_start;dur=12.5") == 12.5
    assert cold_start_ms('cold_start;desc="load";dur="7"') == 7.0
    assert math.isnan(cold_start_ms("cold_start") or 0.0)  # seen, its duration unknown: still a cold start
    assert cold_start_ms("queue;dur=0.1, total;dur=2") is None  # resident: a hit
    assert cold_start_ms("") is None and cold_start_ms(None) is None
    tally = ModelTally()
    tally.record("200", 0.020, "queue;dur=0.1, cold_start;dur=12.5, total;dur=20")
    tally.record("200", 0.002, "queue;dur=0.1, total;dur=2")
    tally.record("503", 0.001, "queue;dur=0.0, cold_start;dur=3")  # waited for a load that found no room
    tally.record("timeout", 30.0, None)  # never answered: neither a hit nor a miss
    assert (tally.requests, tally.answered, tally.cold_starts, tally.cold_start_ms) == (2, 3, 2, [12.5, 3.0])
    assert tally.errors == {"503": 1, "timeout": 1}


def test_popularity_weights_and_what_is_refused() -> None:
    assert make_mix(["a", "b", "c", "d"], "uniform").weights == (0.25,) * 4
    zipf = make_mix(["a", "b", "c"], "zipf:1.1").weights
    assert zipf[0] / zipf[1] == pytest.approx(2**1.1) and zipf[0] / zipf[2] == pytest.approx(3**1.1)
    assert sum(zipf) == pytest.approx(1.0)
    for bad in ("zipf", "zipf:x", "zipf:-1", "pareto", "uniform:2"):
        with pytest.raises(ValueError, match="uniform' or 'zipf:S"):
            parse_popularity(bad)


def test_the_draw_replays_from_its_seed_and_follows_the_weights() -> None:
    mix = make_mix(["a", "b", "c"], "zipf:1.1")
    draw = ModelDraw(mix.cumulative, draw_seed(7, 0))
    again = ModelDraw(mix.cumulative, draw_seed(7, 0))
    seq = [draw.next() for _ in range(20_000)]
    assert seq == [again.next() for _ in range(20_000)]
    other = ModelDraw(mix.cumulative, draw_seed(7, 1))
    assert seq[:50] != [other.next() for _ in range(50)]  # each process its own stream
    counts = Counter(seq)
    for k, w in enumerate(mix.weights):
        assert counts[k] / len(seq) == pytest.approx(w, abs=0.015)


def test_patterns_expand_in_place_sorted_and_names_stay_as_listed() -> None:
    index = ["zoo_c", "digits", "zoo_a", "zoo_b", "zoo_a"]  # a name per version, as the index lists them
    assert expand(["digits", "zoo_*"], index) == ["digits", "zoo_a", "zoo_b", "zoo_c"]
    assert expand(["zoo_b", "zoo_[ab]", "x"], index) == ["zoo_b", "zoo_a", "x"]
    with pytest.raises(ValueError, match="matches no model"):
        expand(["nope*"], index)
    with pytest.raises(ValueError, match="repository index"):
        expand(["zoo_*"], None)


# ---- cold starts counted end to end, against a stand-in that sends them ------------------------------------------


class OneModelCache(ThreadingHTTPServer):
    """Answers every POST 200; a request for another model than the previous one's is a cold start (12.5 ms)."""

    daemon_threads = True

    def __init__(self) -> None:
        self.last: str | None = None
        self.arrivals: list[str] = []
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _CacheHandler)


class _CacheHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    server: OneModelCache

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        model = self.path.split("/")[3]  # /v1/models/<name>/classify
        with self.server.lock:
            cold = self.server.last != model
            self.server.last = model
            self.server.arrivals.append(model)
        body = b'{"results": []}'
        self.send_response(200)
        self.send_header("server-timing", "queue;dur=0.1")
        if cold:  # a second Server-Timing line: the client must read both
            self.send_header("server-timing", "cold_start;dur=12.5, total;dur=13")
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self.send_response(404)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def one_model_cache() -> Iterator[OneModelCache]:
    server = OneModelCache()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_cold_starts_counted_match_a_replay_of_the_written_sequence(
    one_model_cache: OneModelCache, tmp_path: Path
) -> None:
    url = f"http://127.0.0.1:{one_model_cache.server_address[1]}"
    sequence = tmp_path / "sequence.txt"
    report = report_of(loadtest(url, "--models", "a,b,c", "--popularity", "zipf:1", "--seed", "3", "--mode",
                                "closed", "--concurrency", "1", "--duration", "0.5", "--warmup", "0", "--drain", "5",
                                "--max-requests", "300", "--no-progress", "--json", "--write-sequence",
                                str(sequence)))  # fmt: skip
    names = sequence.read_text().splitlines()
    assert names == one_model_cache.arrivals  # one client: the order sent is the order the server saw
    assert len(names) == report["sequence_requests"] == report["sent"] + 1 and names[0] == report["preflight"] == "a"
    # No warm-up, one client: the requests after the preflight were measured (all but perhaps the last, sent as the
    # window closed), so a replay of a one-model cache over them gives exactly the misses the stand-in reported.
    (step,) = report["steps"]
    measured = names[: 1 + step["measured"]]
    misses = Counter(b for a, b in itertools.pairwise(measured) if a != b)
    assert report["cold_starts"] == sum(misses.values()) > 0
    assert {n: m["cold_starts"] for n, m in step["models"].items()} == {n: misses[n] for n in "abc"}
    assert report["hit_rate"] == pytest.approx(1 - sum(misses.values()) / step["answered"])
    assert all(m["cold_start_ms"] == {"p50": 12.5, "max": 12.5} for m in step["models"].values() if m["cold_starts"])
    assert_models_sum_to_the_step(step)


# ---- a real server, every model resident --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def zoo(digits_export: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """digits and three copies of it (zoo_a, zoo_b, zoo_c), all loaded at start, repository control on."""
    root = copy_model(digits_export, tmp_path_factory.mktemp("zoo"))
    for name in ZOO:
        copy_model(digits_export, root, as_name=name)
    log = tmp_path_factory.mktemp("zoo-log") / "server.log"
    running = start_server(root, log, "--admin-token", TOKEN, real_models=())
    yield running
    stop_server(running)


def served(url: str) -> dict[str, float]:
    return {name: metric_value(url, "visionserve_requests_total", model=name) for name in ZOO}


def test_zipf_sends_most_to_the_first_model_and_every_model_is_a_hit(zoo: RunningServer) -> None:
    report = report_of(loadtest(zoo.url, "--models", ",".join(ZOO), "--popularity", "zipf:4", "--mode", "closed",
                                "--concurrency", "2", *SHORT))  # fmt: skip
    (step,) = report["steps"]
    assert step["requests"] > 20 and step["errors"] == {}, step
    models = step["models"]
    assert list(models) == list(ZOO) and models["zoo_a"]["weight"] > 0.9
    assert models["zoo_a"]["share"] > 0.8 > models["zoo_b"]["share"] + models["zoo_c"]["share"]
    assert_models_sum_to_the_step(step)
    # All resident: no response carried cold_start.
    assert step["hit_rate"] == 1.0 and step["cold_starts"] == 0 and report["hit_rate"] == 1.0
    assert all(m["cold_starts"] == 0 and m["cold_start_ms"] is None for m in models.values())
    a = models["zoo_a"]["latency_ms"]
    assert 0 < a["p50"] <= a["p99"]
    assert report["models"]["zoo_a"]["requests"] == models["zoo_a"]["requests"]  # one step: the totals are its own


def test_open_loop_over_two_processes_spreads_uniformly_and_writes_each_request_sent(
    zoo: RunningServer, tmp_path: Path
) -> None:
    sequence = tmp_path / "seq.txt"
    before = served(zoo.url)
    report = report_of(loadtest(zoo.url, "--models", ",".join(ZOO), "--mode", "open", "--rate", "60", "--arrival",
                                "constant", "--processes", "2", "--write-sequence", str(sequence), "--out",
                                str(tmp_path / "out"), *SHORT))  # fmt: skip
    after = served(zoo.url)
    (step,) = report["steps"]
    # 60/s constant for 1.3 s (warm-up included) shared over two processes: 78 sent, 60 of them measured.
    assert step["sent"] == report["sent"] == 78 and step["measured"] == 60 and step["errors"] == {}, step
    assert_models_sum_to_the_step(step)
    assert all(m["weight"] == pytest.approx(1 / 3) and m["measured"] >= 8 for m in step["models"].values()), step
    names = sequence.read_text().splitlines()
    assert len(names) == report["sequence_requests"] == 79  # and the preflight's, first
    # Each model's lines are the requests the server counted for it.
    assert Counter(names) == {n: round(after[n] - before[n]) for n in ZOO}
    rows = (tmp_path / "out" / "models.csv").read_text().splitlines()
    assert rows[0].startswith("step,model,") and len(rows) == 1 + len(ZOO)


def test_a_pattern_expands_from_the_repository_index(zoo: RunningServer) -> None:
    run = loadtest(zoo.url, "--models", "zoo_*", "--admin-token", TOKEN, "--concurrency", "1", *SHORT)
    report = report_of(run)
    assert list(report["models"]) == list(ZOO)  # sorted, and digits (outside the pattern) not driven
    assert report["popularity"] == "uniform" and report["seed"] == 0
    refused = loadtest(zoo.url, "--models", "zoo_*", "--concurrency", "1", *SHORT)
    assert refused.returncode == 2 and "403" in refused.stderr and "--admin-token" in said(refused.stderr)
    nothing = loadtest(zoo.url, "--models", "nope*", "--admin-token", TOKEN, *SHORT)
    assert nothing.returncode == 2 and "matches no model" in said(nothing.stderr)


def test_the_human_table_has_a_row_per_model_and_the_hit_rate(zoo: RunningServer) -> None:
    cmd = ["--models", "zoo_a,zoo_b", "--concurrency", "1", *SHORT[:-1]]
    run = loadtest(zoo.url, *cmd)
    assert run.returncode == 0, run.stderr
    assert "hit rate 100.0%: 0 cold starts" in said(run.stdout)
    assert "zoo_a" in run.stdout and "zoo_b" in run.stdout and "zoo_c" not in run.stdout
    wrong = loadtest(zoo.url, "--model", "zoo_a", "--popularity", "zipf:2", *SHORT)
    assert wrong.returncode == 2 and "go with --models" in said(wrong.stderr)


# ---- a real server with a memory budget: cold starts that happen -------------------------------------------------

ON_DEMAND = 'residency = "on_demand"\nmax_batch_size = 1\nmax_queue_delay_ms = 0\n[faults]\nresident_bytes = {}\n'
LRU_REQUESTS = 40  # the cold-start step's length, in requests


def lru_misses(names: list[str], capacity: int) -> int:
    """Misses of an ideal LRU cache of ``capacity`` models over ``names`` after the first (which fills it)."""
    cache: list[str] = []
    misses = 0
    for i, name in enumerate(names):
        if name in cache:
            cache.remove(name)
        else:
            misses += i > 0
            if len(cache) == capacity:
                cache.pop(0)
        cache.append(name)
    return misses


def test_cold_starts_under_a_real_budget_match_an_lru_replay_of_the_sequence(
    digits_export: Path, tmp_path: Path
) -> None:
    """Four on-demand models of 100 MB (by their config), a budget of 250 MB: two resident at a time, the least
    recently used evicted for a load. One client, so the server meets the requests in the order written."""
    root = tmp_path / "repo"
    for name in ("lru_a", "lru_b", "lru_c", "lru_d"):
        copy_model(digits_export, root, as_name=name)
        (root / name / "config.toml").write_text(ON_DEMAND.format(100_000_000))
    try:
        server = start_server(root, tmp_path / "server.log", "--admin-token", TOKEN, "--memory-budget", "cpu=250MB",
                              "--min-residency-s", "0", real_models=())  # fmt: skip
    except Exception:
        log = (tmp_path / "server.log").read_text(errors="replace") if (tmp_path / "server.log").exists() else ""
        if "--memory-budget" in log or "residency" in log:
            pytest.skip("this server has no on-demand models under a memory budget yet")
        raise
    sequence = tmp_path / "seq.txt"
    # A step bounded by its count, not its time: 40 requests, about 40% of them paying a real load, however long the
    # loads take here (a 1.5 s window once had to hold more than 10 of them; the duration is only a backstop).
    report = report_of(loadtest(server.url, "--models", "lru_*", "--admin-token", TOKEN, "--popularity", "zipf:1",
                                "--concurrency", "1", "--duration", "120", "--warmup", "0", "--drain", "10",
                                "--max-requests", str(LRU_REQUESTS), "--no-progress", "--json", "--write-sequence",
                                str(sequence)))  # fmt: skip
    stop_server(server)
    (step,) = report["steps"]
    assert step["errors"] == {} and step["requests"] == LRU_REQUESTS, step
    names = sequence.read_text().splitlines()[: 1 + step["measured"]]
    assert report["cold_starts"] == lru_misses(names, 2) > 0
    assert 0 < report["hit_rate"] < 1
    cold = [m["cold_start_ms"] for m in step["models"].values() if m["cold_starts"]]
    assert cold and all(0 < c["p50"] <= c["max"] for c in cold)
    assert_models_sum_to_the_step(step)
