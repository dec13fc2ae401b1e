"""Overload and drain, against a real server whose capacity is fixed and measured first.

``paced`` is the trained digits model with a 40 ms delay injected into every batch (``[faults] delay_ms``) and
batches of at most 4: about 95 requests/s however fast the machine, so that three times its capacity stays within
what one Python client process can send on two cores. Run with ``-s`` to see the figures.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from loadtest.http1 import Http1Client
from loadtest.openloop import Record, Request, run_open_loop
from service.core.percentile import percentile
from service.launcher import children
from tests.http.conftest import wait_for_metric
from tests.reliability.clients import rss_mb
from tests.reliability.conftest import RunningServer, add_variant, start_server, stop_server

DIGIT = (Path(__file__).parents[2] / "examples" / "digit-3.png").read_bytes()
PATH = "/v1/models/paced/classify"
REQUEST = Request(PATH, DIGIT, {"Content-Type": "image/png"}, "good")
MAX_BATCH, QUEUE, DELAY_MS = 4, 32, 40.0
HELD_S = 2.0
OVERLOAD_S = 15.0  # long enough for the queue to fill and stay full (it fills in well under a second at 3x)
STALLED_S = 0.1  # the generator's send lag p99 past which a run measured a stalled machine
PACED = (
    f"max_batch_size = {MAX_BATCH}\nmax_queue_delay_ms = 0\nmax_queue_size = {QUEUE}\n[faults]\ndelay_ms = {DELAY_MS}\n"
)


def server_rss_mb(server: RunningServer) -> float:
    """The resident memory of the supervisor and every process it started."""
    pid = server.process.pid
    return rss_mb(pid) + sum(rss_mb(child) for child in children(pid))


async def closed_loop(url: str, *, concurrency: int, duration_s: float) -> float:
    """Answered requests per second from ``concurrency`` clients that send as soon as they are answered."""
    client = Http1Client(url, timeout_s=30)
    answered = 0
    end = time.perf_counter() + duration_s

    async def loop() -> None:
        nonlocal answered
        while time.perf_counter() < end:
            if await client.post(PATH, DIGIT, REQUEST.headers) == 200:
                answered += 1

    started = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    await client.aclose()
    return answered / (time.perf_counter() - started)


def capacity(server: RunningServer) -> float:
    asyncio.run(closed_loop(server.url, concurrency=8, duration_s=2))  # warm up connections and the batcher
    return asyncio.run(closed_loop(server.url, concurrency=16, duration_s=4))


def summary(records: list[Record]) -> Counter[str]:
    return Counter(r.outcome for r in records)


def at_once_s(accepted: list[Record]) -> float:
    """What "at once" means in this run: under half an accepted request's median answer. An accepted request waited
    its turn in the queue (batches held DELAY_MS each by its config) and crossed the same front end and transport
    a refusal crosses; a refusal that had waited its turn would take about as long. Fixed bounds (5 ms, then a
    quarter of a batch) measured the machine: refusals took 6.2 ms here at three times capacity with the load
    generator on the same two cores, and 114 ms (p50) with everything pinned to one shared core, where the
    quickest accepted answer took 64 ms and the median 624 ms."""
    return percentile([r.service_s for r in accepted], 0.5) / 2


def test_three_times_capacity_is_refused_early_and_accepted_work_stays_within_the_queue_bound(
    repo_copy: Path, tmp_path: Path
) -> None:
    add_variant(repo_copy, "paced", PACED)
    server = start_server(repo_copy, tmp_path / "server.log")
    try:
        measured = capacity(server)
        time.sleep(1)
        rss_before = server_rss_mb(server)
        rate = 3 * measured
        for _attempt in range(2):
            records = asyncio.run(run_open_loop(server.url, [REQUEST], rate=rate, duration_s=OVERLOAD_S, timeout_s=20))
            # The generator shares the server's cores: when it could not send on schedule, the machine stalled (CI
            # saw a send lag p99 of 476 ms and refusals' p99 of 184 ms in one run, against 1.5 and 3 ms in others)
            # and the run measured the machine, not the queue's bound. Measured again once; a second stall fails.
            if percentile([r.sent_s - r.due_s for r in records], 0.99) <= STALLED_S:
                break
            print("\noverload: the load generator fell behind its schedule (a machine stall): measuring again")
        time.sleep(2)
        rss_after = server_rss_mb(server)
        outcomes = summary(records)
        accepted = [r for r in records if r.outcome == "200"]
        refused = [r for r in records if r.outcome in ("503", "429")]
        # The queue's own bound: what is queued ahead (max_queue_size images), the batch computing and the one
        # forming, at the rate the server computed meanwhile (images/s = requests/s: one image per request), and one
        # batch more for that rate being a mean over the run (a p99 request meets the slower batches); plus what lies
        # outside the queue, measured in this run: the refusals' p99 (the same front end and transport, no queue) and
        # the generator's send lag p99 (latency runs from the schedule). A fixed 100 ms for it was this machine's
        # figure (with 50 ms, a run beside other work saw a p99 of 486 ms against a bound of 466).
        served = len(accepted) / OVERLOAD_S
        p99_s = percentile([r.latency_s for r in accepted], 0.99)
        refusal_p50_s = percentile([r.service_s for r in refused], 0.5)
        refusal_p99_s = percentile([r.service_s for r in refused], 0.99)
        lag_p99_s = percentile([r.sent_s - r.due_s for r in records], 0.99)
        bound_s = (QUEUE + 3 * MAX_BATCH) / served + refusal_p99_s + lag_p99_s
        at_once = at_once_s(accepted)
        print(
            f"\noverload: capacity {measured:.1f} req/s (closed loop, 16 clients), offered {rate:.1f} req/s for "
            f"{OVERLOAD_S:g} s "
            f"({len(records)} requests): {dict(outcomes)}; accepted {served:.1f} req/s, p50 "
            f"{percentile([r.latency_s for r in accepted], 0.5) * 1e3:.0f} ms, p99 {p99_s * 1e3:.0f} ms against the "
            f"queue's bound of {bound_s * 1e3:.0f} ms; refusals p50 {refusal_p50_s * 1e3:.2f} ms, p99 "
            f"{refusal_p99_s * 1e3:.2f} ms (at once: under {at_once * 1e3:.1f} ms), "
            f"Retry-After {sorted({r.retry_after for r in refused}, key=str)}; "
            f"client send lag p99 {lag_p99_s * 1e3:.1f} ms; server RSS {rss_before:.0f} -> {rss_after:.0f} MiB"
        )
        assert set(outcomes) <= {"200", "503"}, outcomes  # no timeouts, no 504, no dropped connections
        assert len(refused) > len(records) / 3  # two thirds of the offer is over capacity
        assert all(r.retry_after for r in refused)
        assert refusal_p50_s < at_once
        assert p99_s <= bound_s
        assert rss_after - rss_before < 30
        with server.client() as client:
            assert client.get("/v2/health/ready").status_code == 200
            assert client.post(PATH, content=DIGIT, headers=REQUEST.headers).status_code == 200
    finally:
        assert stop_server(server) == 0


def test_sigterm_at_70_percent_load_answers_everything_accepted_and_refuses_the_rest_at_once(
    repo_copy: Path, tmp_path: Path
) -> None:
    add_variant(repo_copy, "paced", PACED)
    # One request held HELD_S in a model of its own is computing when SIGTERM comes, so the drain lasts that long by
    # construction: the paced load meets it (503 at once) however quickly the paced queue empties. Without it the
    # drain lasted as long as the paced queue's last batch, and one run under the fast-model check sent nothing in it.
    add_variant(repo_copy, "held", f"max_queue_delay_ms = 0\n[faults]\ndelay_ms = {HELD_S * 1000}\n")
    server = start_server(repo_copy, tmp_path / "server.log", "--drain-timeout-s", "10")
    signalled: dict[str, float] = {}
    held: dict[str, int] = {}
    held_computing = threading.Event()

    def hold() -> None:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            held["status"] = client.post("/v1/models/held/classify", content=DIGIT, headers=REQUEST.headers).status_code

    def watch_held() -> None:
        wait_for_metric(server.url, "visionserve_inflight_batches", 1, model="held")
        held_computing.set()

    def watch_exit() -> None:
        server.process.wait(30)
        signalled["exited"] = time.monotonic()

    def watch_ready() -> None:
        """The first moment the server is seen draining (readiness answers 400, v2's "not ready", or no longer
        takes connections): a lasting state (the held batch keeps the drain going HELD_S), so a request sent after
        it meets a draining server, however late the signal was handled. Each poll on a new connection (a kept one
        closed by the drain is no sign of anything)."""
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                status = httpx.get(server.url + "/v2/health/ready", timeout=5).status_code
            except httpx.ConnectError:
                status = 0
            except httpx.TransportError:
                continue
            if status != 200:
                signalled["not_ready"] = time.monotonic()
                signalled["seen"] = status
                return
            time.sleep(0.005)

    def tick(elapsed_s: float) -> None:
        if elapsed_s >= 3 and not held:
            held["status"] = 0
            threading.Thread(target=hold, daemon=True).start()
            threading.Thread(target=watch_held, daemon=True).start()
        if elapsed_s >= 4 and held_computing.is_set() and not signalled:
            server.process.send_signal(signal.SIGTERM)
            signalled["at_s"] = elapsed_s
            signalled["wall"] = time.monotonic()
            threading.Thread(target=watch_exit, daemon=True).start()
            threading.Thread(target=watch_ready, daemon=True).start()

    try:
        measured = capacity(server)
        rate = 0.7 * measured
        records = asyncio.run(run_open_loop(server.url, [REQUEST], rate=rate, duration_s=8, timeout_s=20, on_tick=tick))
        code = server.process.wait(20)
        time.sleep(0.1)  # the watcher's own wake-up
        exited_s = signalled["exited"] - signalled["wall"]
    except subprocess.TimeoutExpired:
        server.process.kill()
        raise
    finally:
        stop_server(server)
    # The signal went out at ``at`` on the schedule's clock (due times) or a little later (the generator's lag):
    # the request due at ``at`` was sent after it, so its send time bounds the signal from above.
    at = signalled["at_s"]
    signal_s = min(r.sent_s for r in records if r.due_s >= at)
    assert "not_ready" in signalled, "readiness never said the server was draining"
    draining_s = signal_s + signalled["not_ready"] - signalled["wall"]
    # Out well before the signal: done before it, or sent earlier than it by more than a request took to be
    # answered before it (this run's p99), so it reached the server before the drain began.
    pre_signal = [r for r in records if r.done_s < at]
    reach_s = percentile([r.service_s for r in pre_signal], 0.99)
    before = [r for r in records if r.done_s < at or r.sent_s < at - reach_s]
    after = [r for r in records if r.sent_s > draining_s]  # sent once readiness had said the server drains
    before_outcomes, after_outcomes = summary(before), summary(after)
    between = summary([r for r in records if signal_s <= r.sent_s <= draining_s])
    refusals = [r.service_s for r in after if r.outcome == "503"]
    at_once = at_once_s([r for r in pre_signal if r.outcome == "200"])
    print(
        f"\ndrain: capacity {measured:.1f} req/s, offered {rate:.1f} req/s, SIGTERM at {at:.1f} s (sent by "
        f"{signal_s:.3f} s), seen draining at {draining_s:.3f} s ({signalled['seen'] or 'refused'}; sent between: "
        f"{dict(between)}); sent over {reach_s * 1e3:.0f} ms before it: "
        f"{dict(before_outcomes)}; after draining was seen: {dict(after_outcomes)} (503 p50 "
        f"{percentile(refusals, 0.5) * 1e3:.2f} ms, at once: under {at_once * 1e3:.1f} ms); exit code {code} "
        f"{exited_s:.2f} s after the signal (drain timeout 10 s)"
    )
    assert code == 0
    assert exited_s < 10
    assert held["status"] == 200  # computing at SIGTERM: answered, not dropped
    assert set(before_outcomes) == {"200"}, before_outcomes  # nothing accepted was dropped
    # After the signal: refused with 503 at once while the server drains; once it has gone, connections are
    # refused by the kernel (nobody listens) -- never a timeout or an answer cut short.
    assert set(after_outcomes) <= {"503", "connection"}, after_outcomes
    assert after_outcomes["503"] > 0
    assert percentile(refusals, 0.5) < at_once
    with httpx.Client() as client:  # the port is closed: the server has gone
        try:
            client.get(server.url + "/v2/health/live", timeout=1)
            raise AssertionError("the server still answers after exiting")
        except httpx.TransportError:
            pass
