"""Faults inside the server, against a real server process: a runtime whose forward never returns, a runtime that
raises on every batch. Both are the trained digits model with a ``[faults]`` table (service/runtime/faults.py).

Run with ``-s`` to see the figures.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tests.reliability.conftest import add_variant, start_server, stop_server

DIGIT = (Path(__file__).parents[2] / "examples" / "digit-3.png").read_bytes()
PNG = {"Content-Type": "image/png"}


def classify(client: httpx.Client, model: str, **params: Any) -> httpx.Response:
    return client.post(f"/v1/models/{model}/classify", content=DIGIT, headers=PNG, params=params)


def metric(client: httpx.Client, name: str, model: str) -> float:
    """The value of ``name`` for ``model`` in the server's /metrics text (summed over its other labels)."""
    lines = client.get("/metrics").text.splitlines()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{") and f'model="{model}"' in line
    )


def state_of(client: httpx.Client, model: str) -> dict[str, Any]:
    """The engine's state as model metadata reports it: scalar parameters (``state``, ``state_reason``, ...)."""
    return dict(client.get(f"/v2/models/{model}").json()["parameters"])


def test_a_hung_forward_times_out_is_replaced_and_readiness_tells_the_truth(repo_copy: Path, tmp_path: Path) -> None:
    add_variant(
        repo_copy,
        "wedged",
        # A replacement that takes 3 s to load (as a large model's would): readiness must say so meanwhile; one run
        # with 1 s saw the REPLACING state in metadata but no not-ready answer among its polls.
        "max_queue_delay_ms = 0\ninstance_stuck_after_s = 1.5\n[faults]\nhang_at_batch = 0\nload_delay_ms = 3000\n",
    )
    server = start_server(repo_copy, tmp_path / "server.log")
    try:
        with server.client() as client:
            assert client.get("/v2/models/wedged/ready").status_code == 200
            # The first batch hangs: a request with a deadline gets 504 at its deadline.
            started = time.monotonic()
            hung = classify(client, "wedged", timeout_ms=400)
            deadline_answer_s = time.monotonic() - started
            assert hung.status_code == 504, hung.text
            # A request without a deadline, sent while the instance is wedged, waits for the replacement.
            queued: dict[str, Any] = {}

            def send_queued() -> None:
                with server.client() as other:
                    t0 = time.monotonic()
                    queued["response"] = classify(other, "wedged")
                    queued["s"] = time.monotonic() - t0

            sender = threading.Thread(target=send_queued)
            sender.start()
            # Readiness while stuck and replaced: poll every 20 ms for up to 30 s; the other model keeps serving.
            seen: list[tuple[float, int, str]] = []
            other_statuses: list[int] = []
            poll_deadline = time.monotonic() + 30
            while time.monotonic() < poll_deadline:
                ready = client.get("/v2/models/wedged/ready").status_code
                state = state_of(client, "wedged")
                seen.append((time.monotonic() - started, ready, state["state"]))
                other_statuses.append(classify(client, "digits").status_code)
                # Done once the replacement serves: replaced, READY in metadata and ready, in that order of polls
                # (a ready poll just before the hang was declared, then REPLACING in metadata, is not done; the break
                # on "replaced" alone once ended the loop there, with no not-ready poll seen).
                if state.get("replaced") == 1 and state["state"] == "READY" and ready == 200:
                    break
                time.sleep(0.02)
            sender.join(30)
            assert "response" in queued, "the queued request got no answer within 30 s"
            not_ready = [t for t, ready, s in seen if ready != 200]
            print(
                f"\nhung forward: 504 after {deadline_answer_s * 1000:.0f} ms (deadline 400 ms); not ready from "
                f"{min(not_ready, default=float('nan')):.2f} s to {max(not_ready, default=float('nan')):.2f} s "
                f"after the hang began (stuck bound 1.5 s); states seen: {sorted({s for _, _, s in seen})}; "
                f"queued request {queued['response'].status_code} after {queued['s']:.2f} s; "
                f"digits during it: {len(other_statuses)} requests, statuses {sorted(set(other_statuses))}"
            )
            assert 0.3 <= deadline_answer_s < 1.4
            assert not_ready, "readiness never reported the stuck instance"
            assert min(not_ready) >= 1.4, "not ready before the stuck bound passed"
            assert "REPLACING" in {s for _, _, s in seen}
            assert seen[-1][1] == 200 and seen[-1][2] == "READY"
            assert queued["response"].status_code == 200, queued["response"].text
            assert set(other_statuses) == {200}
            # The replacement serves; the metadata counts the replacement.
            assert classify(client, "wedged").status_code == 200
            assert state_of(client, "wedged")["replaced"] == 1
            assert metric(client, "visionserve_instances_replaced_total", "wedged") == 1
            assert metric(client, "visionserve_model_ready", "wedged") == 1
        assert stop_server(server) == 0  # the engine exits although a runtime thread was abandoned
    finally:
        stop_server(server)
    assert "gave no answer in 1.5 s" in (tmp_path / "server.log").read_text()


def test_a_runtime_that_raises_fails_its_items_alone_and_reports_unhealthy(repo_copy: Path, tmp_path: Path) -> None:
    add_variant(
        repo_copy,
        "broken",
        "max_queue_delay_ms = 0\nunhealthy_after_failed_batches = 3\n[faults]\nfail_after_batches = 0\n",
    )
    server = start_server(repo_copy, tmp_path / "server.log")
    try:
        with server.client() as client:
            assert client.get("/v2/models/broken/ready").status_code == 200
            statuses = []
            for _ in range(3):
                answer = classify(client, "broken")
                statuses.append(answer.status_code)
                assert "injected fault" in answer.json()["error"]
                assert "Traceback" not in answer.text
            # Several files in one request: each fails alone (200 with an error in each file's place).
            files = [("file", (f"d{i}.png", DIGIT, "image/png")) for i in range(3)]
            multi = client.post("/v1/models/broken/classify", files=files)
            assert multi.status_code == 200
            assert all("injected fault" in r["error"] for r in multi.json()["results"])
            deadline = time.monotonic() + 10  # the engine announces the state change; the front ends hear it
            while (ready := client.get("/v2/models/broken/ready").status_code) == 200 and time.monotonic() < deadline:
                time.sleep(0.02)
            state = state_of(client, "broken")
            digits = [classify(client, "digits").status_code for _ in range(20)]
            server_ready = client.get("/v2/health/ready").status_code
            print(
                f"\nraising runtime: statuses {statuses}; model ready -> {ready}, state {state['state']} "
                f"({state['state_reason']}); digits {sorted(set(digits))} x{len(digits)}; server ready {server_ready}"
            )
            assert statuses == [500, 500, 500]
            assert ready != 200 and state["state"] == "UNHEALTHY"
            assert "injected fault" in state["state_reason"]
            assert set(digits) == {200}
            assert client.get("/v2/models/digits/ready").status_code == 200
            assert server_ready == 200
            assert metric(client, "visionserve_model_ready", "broken") == 0
            assert metric(client, "visionserve_model_ready", "digits") == 1
            errors = [
                float(line.rsplit(" ", 1)[1])
                for line in client.get("/metrics").text.splitlines()
                if line.startswith("visionserve_requests_total{")
                and 'model="broken"' in line
                and 'outcome="error"' in line
            ]
            assert sum(errors) == 3  # the single-image requests (the multipart one is a 200 carrying each file's error)
    finally:
        assert stop_server(server) == 0


def huge_png(side: int = 6000) -> bytes:
    """A 36-megapixel PNG of one colour: about 120 KB to send, over 100 MB of pixels to decode."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (side, side), (120, 60, 200)).save(buf, "PNG")
    return buf.getvalue()


async def _saturate_decoding(
    url: str, huge: bytes, *, clients: int, duration_s: float, deadline_ms: int
) -> dict[str, Any]:
    import asyncio
    from collections import Counter

    from loadtest.http1 import ConnectionFailed, Http1Client
    from service.core.percentile import percentile

    hostile = Http1Client(url, timeout_s=60)
    prober = Http1Client(url, timeout_s=60)
    end = time.perf_counter() + duration_s
    huge_outcomes: Counter[str] = Counter()
    small_outcomes: Counter[str] = Counter()
    small_latency: list[float] = []

    async def flood() -> None:
        while time.perf_counter() < end:
            try:
                huge_outcomes[str(await hostile.post("/v1/models/digits/classify", huge, PNG))] += 1
            except (TimeoutError, ConnectionFailed) as exc:
                huge_outcomes[type(exc).__name__] += 1

    async def probe() -> None:
        await asyncio.sleep(1.0)  # the flood has filled the pool
        while time.perf_counter() < end - 1.0:
            started = time.perf_counter()
            status = await prober.post(f"/v1/models/digits/classify?timeout_ms={deadline_ms}", DIGIT, PNG)
            small_latency.append(time.perf_counter() - started)
            small_outcomes[str(status)] += 1
            await asyncio.sleep(0.05)

    await asyncio.gather(probe(), *(flood() for _ in range(clients)))
    await hostile.aclose()
    await prober.aclose()
    return {
        "huge": dict(huge_outcomes),
        "small": dict(small_outcomes),
        "p50_ms": percentile(small_latency, 0.5) * 1e3,
        "p99_ms": percentile(small_latency, 0.99) * 1e3,
        "max_ms": max(small_latency) * 1e3,
    }


def test_huge_images_saturating_the_decoders_do_not_hold_up_small_ones(repo_copy: Path, tmp_path: Path) -> None:
    import asyncio

    huge = huge_png()
    server = start_server(repo_copy, tmp_path / "server.log")
    try:
        # What one huge image costs alone on this machine (the quicker of two: the first also warms the decoders):
        # the small requests' deadline and bounds are that and a share of it, so a slower machine loosens them in
        # step (a fixed 1000 ms was this machine's figure). A small request queued behind huge decodes would wait for
        # a decoder, and with eight clients keeping the decoders full, most would wait a whole decode or more.
        alone_s = []
        with server.client() as client:
            for _ in range(2):
                started = time.monotonic()
                assert classify_bytes(client, huge).status_code == 200
                alone_s.append(time.monotonic() - started)
        one_huge_s = min(alone_s)
        deadline_ms = max(1, round(one_huge_s * 1000))
        seen = asyncio.run(_saturate_decoding(server.url, huge, clients=8, duration_s=12, deadline_ms=deadline_ms))
        print(
            f"\nhuge images: one 36 MP PNG takes {one_huge_s * 1e3:.0f} ms alone; 8 clients sending them for 12 s: "
            f"huge {seen['huge']}; small (deadline {deadline_ms} ms) {seen['small']}, p50 {seen['p50_ms']:.0f} ms, "
            f"p99 {seen['p99_ms']:.0f} ms, max {seen['max_ms']:.0f} ms"
        )
        assert seen["small"] == {"200": sum(seen["small"].values())} and sum(seen["small"].values()) >= 20
        # Typically far quicker than a huge decode (pinned to one shared core: p50 34 ms against 419 ms alone), and
        # every one within the deadline, one huge image's time alone (there, max 261 ms: one scheduler stall).
        assert seen["p50_ms"] < one_huge_s * 1e3 / 4
        assert seen["max_ms"] < one_huge_s * 1e3
        assert seen["huge"].get("200", 0) > 0  # huge images are still served, at their own pace
        assert set(seen["huge"]) <= {"200", "503"}
    finally:
        assert stop_server(server) == 0


def classify_bytes(client: httpx.Client, data: bytes) -> httpx.Response:
    return client.post("/v1/models/digits/classify", content=data, headers=PNG)
