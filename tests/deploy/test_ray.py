"""The Ray Serve deployment on a real two-node Ray cluster on this machine: two replicas of digits on different
nodes, the load tester against Ray's proxy, and a replica killed under load.

How we know which replica answered: every answer carries ``x-visionserve-replica`` and ``x-visionserve-node``
(deploy/ray/app.py), and each replica's own server counts what it served in its /metrics.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.deploy.conftest import EXAMPLES, ROOT, quiet_server_args, successes
from tests.http.conftest import free_port

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")
serve = pytest.importorskip("ray.serve")

from deploy.ray.app import NODE_HEADER, REPLICA_HEADER, VisionServe  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

APP = "visionserve"
MAX_ONGOING = 4  # per replica, so a killed replica can have lost at most this many requests
CONCURRENCY = 8  # two replicas x MAX_ONGOING: both saturated, the rest queue at the proxy


def _environment() -> dict[str, str]:
    # FACTS.md: without the first, the proxy sends everything to the replica on its own node. The workers import
    # deploy/ from this checkout.
    return {
        "RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING": "0",
        "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""), str(ROOT)) if p),
        "RAY_USAGE_STATS_ENABLED": "0",
    }


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    from ray.cluster_utils import Cluster

    saved = {k: os.environ.get(k) for k in _environment()}
    os.environ.update(_environment())
    started = None
    try:
        started = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 1, "object_store_memory": 100 * 2**20, "include_dashboard": False},
        )
        started.add_node(num_cpus=1, object_store_memory=100 * 2**20)
        ray.init(address=started.address, logging_level=logging.WARNING, log_to_driver=False)
    except Exception as exc:  # pragma: no cover - depends on the machine
        if started is not None:
            started.shutdown()
        pytest.skip(f"Ray cannot start a local cluster here: {exc}")
    try:
        addresses = {node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]}
        assert addresses == {"127.0.0.1"}, f"Ray's nodes left loopback: {addresses}"
        yield started
    finally:
        ray.shutdown()
        started.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="module")
def proxy(cluster: Any, digits_repo: Path) -> Iterator[str]:
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    app = VisionServe.options(
        num_replicas=2,
        autoscaling_config=None,
        max_replicas_per_node=1,
        max_ongoing_requests=MAX_ONGOING,
        ray_actor_options={"num_cpus": 1},
        health_check_period_s=1.0,
    ).bind({"repository": str(digits_repo), "server_args": list(quiet_server_args()), "ready_timeout_s": 120})
    serve.run(app, name=APP, route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


def _servers(repo: Path) -> list[int]:
    """Pids of the replicas' visionserve servers (each replica starts one)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "service.cli" in cmd and "serve" in cmd and str(repo) in cmd:
            found.append(proc.pid)
    return found


def _replicas_seen(url: str, tries: int = 300) -> dict[str, tuple[str, float]]:
    """replica -> (node, its server's success count), from /metrics fetched through the proxy until both answer.

    Right after a load step Ray's router can keep choosing the same replica for a while (60 tries in a row once
    went to one of two), so this asks up to ``tries`` times, pausing a little between tries."""
    seen: dict[str, tuple[str, float]] = {}
    with httpx.Client(base_url=url, timeout=30) as client:
        for _ in range(tries):
            r = client.get("/metrics")
            assert r.status_code == 200, r.text[:300]
            seen[r.headers[REPLICA_HEADER]] = (r.headers[NODE_HEADER], successes(r.text, "digits"))
            if len(seen) == 2:
                break
            time.sleep(0.02)
    return seen


def _loadtest(url: str, out: Path, *, duration_s: float, warmup_s: float) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "service.cli", "loadtest", "--url", url, "--model", "digits",
           "--concurrency", str(CONCURRENCY), "--duration", str(duration_s), "--warmup", str(warmup_s),
           "--drain", "10", "--timeout", "20", "--max-requests", "20000", "--image-size", "64x64",
           "--out", str(out), "--no-progress"]  # fmt: skip
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _finish(process: subprocess.Popen[bytes], out: Path) -> dict[str, Any]:
    output, _ = process.communicate(timeout=90)
    assert process.returncode == 0, output.decode()[-3000:]
    steps: list[dict[str, Any]] = json.loads((out / "results.json").read_text())["steps"]
    assert len(steps) == 1
    return steps[0]


def test_two_replicas_on_two_nodes_answer_correctly_through_the_proxy(proxy: str) -> None:
    import tritonclient.http as triton

    with httpx.Client(base_url=proxy, timeout=60) as client:
        for digit in (3, 6):
            r = client.post(
                "/v1/models/digits/classify?top_k=1",
                content=(EXAMPLES / f"digit-{digit}.png").read_bytes(),
                headers={"content-type": "image/png"},
            )
            assert r.status_code == 200, r.text
            assert r.json()["results"][0]["predictions"][0]["label"] == str(digit)
            assert "server-timing" in r.headers  # the server's own headers come through
    # The v2 protocol through the proxy, with Triton's own client.
    v2 = triton.InferenceServerClient(proxy.removeprefix("http://"))
    assert v2.is_server_ready() and v2.is_model_ready("digits")
    assert v2.get_model_metadata("digits")["name"] == "digits"
    seen = _replicas_seen(proxy)
    assert len(seen) == 2, seen
    assert len({node for node, _ in seen.values()}) == 2, f"both replicas on one node: {seen}"


def test_the_load_tester_through_the_proxy_reaches_both_replicas_without_errors(proxy: str, tmp_path: Path) -> None:
    before = _replicas_seen(proxy)
    step = _finish(_loadtest(proxy, tmp_path, duration_s=6, warmup_s=1), tmp_path)
    assert step["errors"] == {}, step
    assert step["requests"] > 50, step
    after = _replicas_seen(proxy)
    assert after.keys() == before.keys()
    served = {replica: after[replica][1] - before[replica][1] for replica in after}
    print(f"through Ray's proxy: {step['requests']} requests measured; served per replica {served}")
    # Each replica's own server counted load-test requests; together, at least every measured one (the warm-up's
    # and the drain's come on top).
    assert all(n > 0 for n in served.values()), served
    assert sum(served.values()) >= step["requests"]


def test_a_replica_killed_under_load_is_replaced_losing_only_its_requests_in_flight(
    proxy: str, digits_repo: Path, tmp_path: Path
) -> None:
    original = _replicas_seen(proxy)
    names = [n["name"] for n in ray.util.list_named_actors(all_namespaces=True) if "SERVE_REPLICA" in n["name"]]
    assert len(names) == 2, names
    victim_name = next(n for n in names if n.endswith(next(iter(original))))
    victim = ray.get_actor(victim_name, namespace="serve")

    load = _loadtest(proxy, tmp_path, duration_s=15, warmup_s=0)
    # Kill it under load: once Ray's own count of what the replica holds (its replica actor's method) says it is
    # full. Then what it holds is exactly MAX_ONGOING: Ray never hands a replica more, so nothing can arrive between
    # the count and the kill, and the count is the bound on what the run may lose.
    deadline = time.monotonic() + 30
    in_flight = 0
    while time.monotonic() < deadline and load.poll() is None:
        in_flight = ray.get(victim.get_num_ongoing_requests.remote(), timeout=10)
        if in_flight >= MAX_ONGOING:
            break
        time.sleep(0.02)
    assert in_flight >= 1, "the load never reached the replica"
    ray.kill(victim, no_restart=True)
    step = _finish(load, tmp_path)

    lost = sum(step["errors"].values())
    print(f"killed replica held {in_flight} requests; the run lost {lost}: {step['errors']}; ok {step['requests']}")
    # The proxy retries requests it had not yet handed to the dead replica: what is lost is what was in flight on
    # it, which is the count above when the replica was full, and never more than max_ongoing_requests.
    assert lost <= (in_flight if in_flight == MAX_ONGOING else MAX_ONGOING), (in_flight, step)
    assert step["requests"] > 50, step  # the survivor (and then the replacement) kept serving

    deadline = time.monotonic() + 60
    replicas: dict[str, tuple[str, float]] = {}
    while time.monotonic() < deadline:
        replicas = _replicas_seen(proxy, tries=20)
        if len(replicas) == 2 and next(iter(original)) not in replicas:
            break
        time.sleep(1)
    assert len(replicas) == 2 and next(iter(original)) not in replicas, replicas
    # The dead replica's server went with it (SIGTERM on its parent's death), so two servers run, not three.
    deadline = time.monotonic() + 30
    while len(_servers(digits_repo)) != 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert len(_servers(digits_repo)) == 2
