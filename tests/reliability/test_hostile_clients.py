"""Slow and hostile clients must not stop ordinary clients from being served.

A hundred slowloris connections (a complete head, then the body one byte a second) and a hundred connections that
pipeline requests and never read the answers run beside an ordinary closed-loop client; its p99 stays within 2x of
an undisturbed run. Bodies over the limit are refused before they are read in full; stalled heads and bodies are
timed out; header floods and oversized heads are refused with memory bounded. Run with ``-s`` for the figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.frontend.http.connection import MAX_PIPELINED
from tests.reliability.clients import (
    CLASSIFY,
    Run,
    digit_png,
    frontends,
    head,
    never_read,
    ordinary,
    read_status,
    rss_mb,
    slowloris,
)
from tests.reliability.conftest import RunningServer, start_server, stop_server

REQUESTS = 600  # per ordinary run, at concurrency 4
CONCURRENCY = 4
HOSTILE = 100
MAX_BODY_MB = 1


# Every batch of the ordinary clients' model takes at least a floor, by its config: the p99 ratios below compare
# latencies with the same floor on any machine (on a fast one a bare digits p99 of a few ms doubles with any
# scheduler blip, so a 2x limit would measure the machine, not the hostile clients). The floor is sized from this
# machine's own bare p99 (FLOOR_BARE times it, FLOOR_MS at least), measured first on a server without the delay: the
# part of a p99 above a fixed floor scales with the CPU's speed, and so does what the hostile clients add to it, so a
# fixed 10 ms floor gave a ratio that grew on a slower machine; a floor that scales too keeps the ratio the same.
FLOOR_MS = 10
FLOOR_BARE = 1


def bare_p99_ms(repo: Path, log: Path) -> float:
    """The ordinary clients' p99 on this machine against digits with no delay, the same server flags."""
    running = start_server(repo, log, "--workers", "2", "--max-body-mb", str(MAX_BODY_MB))
    try:

        async def measure() -> float:
            await ordinary(running.url, digit_png(), requests=100, concurrency=CONCURRENCY)  # warm up
            runs = [await ordinary(running.url, digit_png(), requests=300, concurrency=CONCURRENCY) for _ in range(2)]
            return min(run.p99_ms for run in runs)

        return asyncio.run(measure())
    finally:
        stop_server(running)


@pytest.fixture(scope="module")
def server(reliability_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("hostile")
    repo = root / "repo"
    shutil.copytree(reliability_repo, repo)
    config = repo / "digits" / "config.toml"
    config.write_text("max_queue_delay_ms = 0\n")
    bare_ms = bare_p99_ms(repo, root / "bare.log")
    floor_ms = max(FLOOR_MS, FLOOR_BARE * bare_ms)
    print(f"\nhostile: bare p99 {bare_ms:.1f} ms; every batch held {floor_ms:.1f} ms")
    config.write_text(f"max_queue_delay_ms = 0\n[faults]\ndelay_ms = {floor_ms:.1f}\n")
    log = root / "server.log"
    running = start_server(repo, log, "--workers", "2", "--max-body-mb", str(MAX_BODY_MB))
    yield running
    stop_server(running)


def port_of(server: RunningServer) -> int:
    return int(server.url.rsplit(":", 1)[1])


def assert_still_serving(server: RunningServer) -> None:
    answer = httpx.post(server.url + CLASSIFY, content=digit_png(), headers={"Content-Type": "image/png"}, timeout=10)
    assert answer.status_code == 200, answer.text


def compare(name: str, undisturbed: list[Run], disturbed: list[Run]) -> float:
    """The better p99 of the disturbed runs over the better p99 of the undisturbed ones (a 2-core machine shared
    with other work: the better of two rounds on each side cancels most of the noise without hiding a real stall)."""
    for i, run in enumerate(undisturbed):
        print(run.line(f"{name} undisturbed #{i + 1}"))
    for i, run in enumerate(disturbed):
        print(run.line(f"{name} disturbed   #{i + 1}"))
    base = min(run.p99_ms for run in undisturbed)
    hit = min(run.p99_ms for run in disturbed)
    ratio = hit / base
    p50_base = min(run.p50_ms for run in undisturbed)
    p50_hit = min(run.p50_ms for run in disturbed)
    print(
        f"{name}: p50 {p50_base:.1f} -> {p50_hit:.1f} ms, p99 {base:.1f} -> {hit:.1f} ms, p99 ratio {ratio:.2f} "
        f"(limit 2.0)"
    )
    for run in (*undisturbed, *disturbed):
        assert set(run.statuses) == {200}, run.statuses
    return ratio


def test_slowloris_bodies_leave_ordinary_clients_served(server: RunningServer) -> None:
    png, port = digit_png(), port_of(server)

    async def main() -> tuple[list[Run], list[Run], list[object]]:
        await ordinary(server.url, png, requests=100, concurrency=CONCURRENCY)  # warm up
        undisturbed, disturbed, stats = [], [], []
        for _ in range(2):
            undisturbed.append(await ordinary(server.url, png, requests=REQUESTS, concurrency=CONCURRENCY))
            stop = asyncio.Event()
            hostile = asyncio.ensure_future(slowloris(port, connections=HOSTILE, stop=stop))
            await asyncio.sleep(2.0)  # all hundred connected and trickling
            disturbed.append(await ordinary(server.url, png, requests=REQUESTS, concurrency=CONCURRENCY))
            stop.set()
            stats.append(await asyncio.wait_for(hostile, 10))
        return undisturbed, disturbed, stats

    undisturbed, disturbed, stats = asyncio.run(main())
    for s in stats:
        print(f"slowloris: {s.opened} connections opened, {s.bytes_sent} body bytes trickled, answers {s.answers}")
    assert compare("slowloris", undisturbed, disturbed) <= 2.0
    assert_still_serving(server)


def test_clients_that_never_read_leave_ordinary_clients_served_and_memory_bounded(server: RunningServer) -> None:
    png, port = digit_png(), port_of(server)
    pids = frontends(server.process.pid)
    assert len(pids) == 2, pids

    async def main() -> tuple[list[Run], list[Run], list[object], float, float]:
        await ordinary(server.url, png, requests=100, concurrency=CONCURRENCY)
        before = sum(rss_mb(p) for p in pids)
        peak = before
        undisturbed, disturbed, stats = [], [], []
        for _ in range(2):
            undisturbed.append(await ordinary(server.url, png, requests=REQUESTS, concurrency=CONCURRENCY))
            stop = asyncio.Event()
            hostile = asyncio.ensure_future(never_read(port, connections=HOSTILE, pipelined=1000, stop=stop))
            await asyncio.sleep(2.0)
            disturbed.append(await ordinary(server.url, png, requests=REQUESTS, concurrency=CONCURRENCY))
            peak = max(peak, sum(rss_mb(p) for p in pids))
            stop.set()
            stats.append(await asyncio.wait_for(hostile, 10))
        return undisturbed, disturbed, stats, before, peak

    undisturbed, disturbed, stats, before, peak = asyncio.run(main())
    for s in stats:
        print(
            f"never-read: {s.connections} connections, {s.requests_sent} pipelined requests ({s.bytes_sent} bytes) "
            "written in full"
        )
    print(f"never-read: front ends' RSS {before:.0f} MiB before, {peak:.0f} MiB at the peak")
    ratio = compare("never-read", undisturbed, disturbed)
    assert peak - before < 100, "the front ends hold what non-reading clients pipelined"
    assert ratio <= 2.0
    assert_still_serving(server)


def test_body_over_the_limit_is_refused_before_it_is_read(server: RunningServer) -> None:
    port, limit = port_of(server), MAX_BODY_MB * 1024 * 1024

    async def announced() -> tuple[int | None, float, int]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        sent = 4096
        started = time.perf_counter()
        writer.write(head(CLASSIFY, port, ["Content-Type: image/png", f"Content-Length: {10 * limit}"]))
        writer.write(b"\0" * sent)
        status = await read_status(reader, 5.0)
        elapsed = time.perf_counter() - started
        writer.close()
        return status, elapsed, sent

    async def chunked() -> tuple[int | None, float, int]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        started = time.perf_counter()
        writer.write(head(CLASSIFY, port, ["Content-Type: image/png", "Transfer-Encoding: chunked"]))
        answer = asyncio.ensure_future(read_status(reader, 20.0))
        chunk, sent = 64 * 1024, 0
        while not answer.done() and sent < 8 * limit and time.perf_counter() - started < 15:
            writer.write(b"%x\r\n" % chunk + b"\0" * chunk + b"\r\n")
            await writer.drain()
            sent += chunk
            await asyncio.sleep(0.01)  # slow enough that no socket buffer hides how much the server had read
        status = await answer
        elapsed = time.perf_counter() - started
        writer.close()
        return status, elapsed, sent

    status, elapsed, sent = asyncio.run(announced())
    print(f"Content-Length 10x over the limit: {status} after {elapsed * 1e3:.0f} ms, {sent} body bytes sent")
    assert status == 413
    assert elapsed < 1.0
    status, elapsed, sent = asyncio.run(chunked())
    print(f"chunked body growing past the limit ({limit} bytes): {status} after {elapsed * 1e3:.0f} ms, "
          f"{sent} bytes sent when it came")  # fmt: skip
    assert status == 413
    assert sent <= limit + 1024 * 1024, "the server read far past the limit before refusing"
    assert_still_serving(server)


async def send_until_refused(port: int, data: bytes, *, budget_bytes: int, budget_s: float) -> tuple[object, int]:
    """Write ``data`` (a head that never ends, in pieces) until the server answers or closes, or the budget is
    spent; (status, or "closed", or "not refused"; bytes written)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    answer = asyncio.ensure_future(read_status(reader, budget_s + 5))
    started, sent = time.perf_counter(), 0
    outcome: object = "not refused"
    try:
        while sent < budget_bytes and time.perf_counter() - started < budget_s and not answer.done():
            piece = data[sent % len(data) :][: 64 * 1024] if sent else data[: 64 * 1024]
            writer.write(piece)
            await asyncio.wait_for(writer.drain(), budget_s)
            sent += len(piece)
            await asyncio.sleep(0.002)
        if answer.done() or sent >= budget_bytes:
            with_answer = await asyncio.wait_for(answer, 5)
            outcome = with_answer if with_answer is not None else "closed"
    except (ConnectionError, OSError, TimeoutError):
        outcome = answer.result() if answer.done() and answer.result() else "closed"
    finally:
        answer.cancel()
        writer.close()
    return outcome, sent


def test_header_floods_and_oversized_heads_are_refused(server: RunningServer) -> None:
    port = port_of(server)
    pids = frontends(server.process.pid)
    before = sum(rss_mb(p) for p in pids)

    def one_shot(data: bytes) -> tuple[object, float]:
        async def go() -> tuple[object, float]:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            started = time.perf_counter()
            writer.write(data)
            try:
                status = await read_status(reader, 10)
            finally:
                writer.close()
            return (status if status is not None else "closed"), time.perf_counter() - started

        return asyncio.run(go())

    flood = head("/v2/health/live", port, [f"X-Flood-{i}: {i}" for i in range(10_000)], method="GET")
    status, elapsed = one_shot(flood)
    print(f"10,000 header lines ({len(flood)} bytes): {status} after {elapsed * 1e3:.0f} ms")
    assert status in (431, 400, "closed")
    big = head("/v2/health/live", port, ["X-Big: " + "a" * (1024 * 1024)], method="GET")
    status, elapsed = one_shot(big)
    print(f"one 1 MiB header value: {status} after {elapsed * 1e3:.0f} ms")
    assert status in (431, 400, "closed")

    endless = head("/v2/health/live", port, [], method="GET")[:-2] + b"X-More: " + b"b" * (1024 * 1024)
    outcome, sent = asyncio.run(send_until_refused(port, endless, budget_bytes=64 * 1024 * 1024, budget_s=15))
    peak = sum(rss_mb(p) for p in pids)
    print(f"a head that never ends: {outcome} after {sent} bytes sent; front ends' RSS {before:.0f} -> {peak:.0f} MiB")
    assert outcome in (431, 400, "closed")
    assert sent <= 4 * 1024 * 1024, "the server read megabytes of a head before refusing it"
    assert peak - before < 50
    assert_still_serving(server)


def test_stalled_heads_and_bodies_are_timed_out(reliability_repo: Path, tmp_path: Path) -> None:
    timeout_s = 2.0
    running = start_server(
        reliability_repo, tmp_path / "server.log", "--workers", "2",
        "--header-timeout-s", str(timeout_s), "--body-timeout-s", str(timeout_s),
    )  # fmt: skip
    port = port_of(running)

    async def trickle(first: bytes, then: bytes | None, *, limit_s: float) -> tuple[object, float]:
        """Send ``first``, then one byte of ``then`` a second (or nothing); what the server did and when."""
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        started = time.perf_counter()
        writer.write(first)
        answer = asyncio.ensure_future(read_status(reader, limit_s + 10))
        i = 0
        try:
            while not answer.done() and time.perf_counter() - started < limit_s:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(answer), 1.0)
                if then is not None and not answer.done():
                    writer.write(then[i % len(then) : i % len(then) + 1])
                    i += 1
            status = await answer if answer.done() else "still open"
        except (ConnectionError, OSError):
            status = "reset"
        finally:
            answer.cancel()
            writer.close()
        return (status if status is not None else "closed"), time.perf_counter() - started

    async def blank_lines_after_an_answer(limit_s: float) -> tuple[object, float]:
        """A keep-alive request answered, then a CRLF a second (which the parser skips, beginning no request)."""
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            assert await read_status(reader, 10) == 200
            await reader.readuntil(b"\r\n\r\n")  # the rest of the head; the body is empty
            started = time.perf_counter()
            while time.perf_counter() - started < limit_s:
                writer.write(b"\r\n")
                with contextlib.suppress(TimeoutError):
                    if await asyncio.wait_for(reader.read(1), 1.0) == b"":
                        return "closed", time.perf_counter() - started
            return "still open", time.perf_counter() - started
        except (ConnectionError, OSError):
            return "reset", time.perf_counter() - started
        finally:
            writer.close()

    body_head = head(CLASSIFY, port, ["Content-Type: image/png", "Content-Length: 100000"])
    limit_s = 4 * timeout_s + 3
    cases = {
        "idle connection (no byte sent)": (b"", None),
        "head trickled 1 byte/s": (b"POST " + CLASSIFY.encode() + b" HTTP/1.1\r\nHost: x\r\n", b"X-Slow: yes\r\n"),
        "body trickled 1 byte/s": (body_head, b"\x89"),
        "body stalled after 1 KiB": (body_head + b"\0" * 1024, None),
    }
    try:

        async def all_at_once() -> dict[str, tuple[object, float]]:
            done = await asyncio.gather(
                *(trickle(*case, limit_s=limit_s) for case in cases.values()), blank_lines_after_an_answer(limit_s)
            )
            return dict(zip([*cases, "blank lines after an answer"], done, strict=True))

        results = asyncio.run(all_at_once())
        for name, (status, elapsed) in results.items():
            print(f"{name}: {status} after {elapsed:.1f} s (timeouts {timeout_s:g} s)")
        assert results["idle connection (no byte sent)"][0] in ("closed", 408)
        assert results["blank lines after an answer"][0] in ("closed", "reset")
        for name in ("head trickled 1 byte/s", "body trickled 1 byte/s", "body stalled after 1 KiB"):
            assert results[name][0] in (408, "closed"), name
        for name, (_, elapsed) in results.items():
            assert elapsed < 2 * timeout_s + 2, name
        assert_still_serving(running)
    finally:
        stop_server(running)


def test_a_deep_pipeline_is_answered_in_order_then_closed(server: RunningServer) -> None:
    """Past MAX_PIPELINED waiting requests the rest are dropped, and the ones taken are still answered, the last
    with ``Connection: close`` (a client retries the unanswered ones on a new connection): never a 400 mid-stream."""
    port = port_of(server)

    async def go() -> tuple[list[int], bool]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head("/v2/health/live", port, [], method="GET") * 200)
        statuses, closed = [], False
        async with asyncio.timeout(20):
            while True:
                status = await read_status(reader, 10)
                if status is None:
                    break
                fields = (await reader.readuntil(b"\r\n\r\n")).lower()
                length = int(fields.split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                statuses.append(status)
                closed = b"connection: close" in fields
        writer.close()
        return statuses, closed

    statuses, closed = asyncio.run(go())
    print(f"200 pipelined requests: {len(statuses)} answered ({set(statuses)}), the last with close: {closed}")
    assert set(statuses) == {200}
    assert MAX_PIPELINED <= len(statuses) <= 200
    assert closed or len(statuses) == 200
