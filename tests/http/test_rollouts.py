"""Rollouts against real server processes (docs/rollouts.md): the shipped digits model as version 1 and a derived
candidate as version 2 (service/bench/rollout/candidates.py), driven through the admin API with httpx.

The candidate is version 1 with its labels permuted, so every answer says which version gave it: a live answer
equal to version 1's was computed by version 1.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service import launcher
from service.bench.rollout.candidates import DIGITS_VERSION, copy_version, held_out_digits, permute_labels
from tests.http.conftest import ADMIN_TOKEN, metric_value, stop_server

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
PNG = {"Content-Type": "image/png"}
DIGITS = held_out_digits(40)


def _repo(root: Path, candidate: str = "permuted", config: str = "") -> Path:
    model = root / "digits"
    shutil.copytree(DIGITS_VERSION.parent, model)
    if candidate == "permuted":
        permute_labels(model / "1", model / "2", seed=3)
    else:
        copy_version(model / "1", model / "2")
    (model / "config.toml").write_text("max_queue_delay_ms = 0\n" + config)
    return root


def _start(repo: Path, log: Path) -> launcher.RunningServer:
    return launcher.start(repo, "--admin-token", ADMIN_TOKEN, log=log, ready_timeout_s=120)


@pytest.fixture
def permuted(tmp_path: Path) -> Iterator[launcher.RunningServer]:
    server = _start(_repo(tmp_path / "repo"), tmp_path / "server.log")
    try:
        yield server
    finally:
        stop_server(server)


def top1(client: httpx.Client, i: int, version: int | None = None, **headers: str) -> tuple[int, int]:
    """(status, top-1 index) of digit ``i`` classified by the model (or one version of it)."""
    path = "/v1/models/digits" + (f"/versions/{version}" if version else "") + "/classify"
    answer = client.post(path, content=DIGITS.pngs[i], headers={**PNG, **headers}, params={"top_k": 1})
    if answer.status_code != 200:
        return answer.status_code, -1
    return 200, answer.json()["results"][0]["predictions"][0]["index"]


def answered(client: httpx.Client, i: int) -> tuple[int, int, int]:
    """(status, top-1 index, the version the answer names) of digit ``i`` classified by the model."""
    answer = client.post("/v1/models/digits/classify", content=DIGITS.pngs[i], headers=PNG, params={"top_k": 1})
    if answer.status_code != 200:
        return answer.status_code, -1, -1
    body = answer.json()
    return 200, body["results"][0]["predictions"][0]["index"], body["version"]


def rollout(client: httpx.Client, action: str = "", **body: Any) -> dict[str, Any]:
    path = "/v2/models/digits/rollout" + (f"/{action}" if action else "")
    answer = client.post(path, json=body, headers=ADMIN) if action or body else client.get(path)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def wait_for(client: httpx.Client, done: Any, timeout_s: float = 30) -> dict[str, Any]:
    """The rollout document once ``done(doc)`` holds (polled; the comparison runs after the live answer)."""
    deadline = time.monotonic() + timeout_s
    while True:
        doc = rollout(client)
        if done(doc) or time.monotonic() > deadline:
            return doc
        time.sleep(0.05)


def test_shadow_never_changes_a_live_answer_and_measures_the_candidate(permuted: launcher.RunningServer) -> None:
    with permuted.client() as client:
        truth = {i: top1(client, i, version=1)[1] for i in range(len(DIGITS.pngs))}
        moved = {i: top1(client, i, version=2)[1] for i in range(len(DIGITS.pngs))}
        assert all(truth[i] != moved[i] for i in truth)  # the candidate differs on every image
        assert rollout(client)["state"] == "none"
        # the evidence to abort on: 30 compared, below the 40 asserted (a third of the 60 copies may be shed)
        started = rollout(client, candidate=2, mode="shadow", fraction=1.0, auto=False, abort_min_samples=30)
        assert (started["state"], started["primary"], started["candidate"]) == ("running", 1, 2)
        live = [top1(client, i % 40) for i in range(60)]
        doc = wait_for(client, lambda d: d["comparison"]["samples"] + d["comparison"]["shed"] >= 60)
        metrics = client.get("/metrics").text
    assert live == [(200, truth[i % 40]) for i in range(60)]  # every live answer is the primary's
    comparison = doc["comparison"]
    print(f"\nshadow of a permuted candidate: {comparison['samples']} compared, {comparison['shed']} shed, "
          f"agreement {comparison['agreement']}, interval [{comparison['agreement_low']:.3f}, "
          f"{comparison['agreement_high']:.3f}], verdict {doc['verdict']}")  # fmt: skip
    assert comparison["samples"] >= 40 and comparison["agreed"] == 0
    assert comparison["agreement_high"] < 0.99 and doc["verdict"] == "abort" and doc["state"] == "running"
    assert comparison["classes"] and all(c["moved_to"] for c in comparison["classes"])
    agreement = [line for line in metrics.splitlines() if line.startswith("visionserve_rollout_agreement{")]
    assert any('model="digits"' in line and 'bound="estimate"' in line for line in agreement), agreement


def test_canary_fraction_holds_and_sticky_routing_sticks(permuted: launcher.RunningServer) -> None:
    n, fraction = 300, 0.3
    with permuted.client() as client:
        truth = {i: top1(client, i, version=1)[1] for i in range(len(DIGITS.pngs))}
        rollout(client, candidate=2, mode="canary", fraction=fraction, auto=False)
        answers = [answered(client, i % 40) for i in range(n)]
        by_candidate = sum(1 for i, (status, index, _) in enumerate(answers) if index != truth[i % 40])
        counted = metric_value(permuted.url, "visionserve_requests_total", version="2", outcome="success")
        assert all(status == 200 for status, _, _ in answers)
        # Each answer names the version that computed it: the candidate's (permuted) answers 2, the primary's 1;
        # and it is counted on that version (the candidate's successes are the canary's answers).
        assert [v for _, _, v in answers] == [
            2 if index != truth[i % 40] else 1 for i, (_, index, _) in enumerate(answers)
        ]
        assert counted == by_candidate
        rollout(client, "abort", reason="next: sticky")
        # The candidate was unloaded by the abort; a new one for the sticky test.
        assert rollout(client)["state"] == "aborted"
    # Binomial: 300 draws at 0.3 have sd 7.9; 4 sd either side fails by chance about once in 16,000 runs.
    sd = (n * fraction * (1 - fraction)) ** 0.5
    print(f"\ncanary at {fraction}: {by_candidate} of {n} answered by the candidate (expected {n * fraction:.0f})")
    assert abs(by_candidate - n * fraction) <= 4 * sd


def test_sticky_canary_gives_one_user_one_version(tmp_path: Path) -> None:
    config = '[rollout]\ncandidate = 2\nmode = "canary"\nfraction = 0.5\nsticky_header = "x-user"\nauto = false\n'
    server = _start(_repo(tmp_path / "repo", config=config), tmp_path / "server.log")
    try:
        with server.client() as client:
            doc = rollout(client)
            assert (doc["state"], doc["mode"], doc["sticky_header"]) == ("running", "canary", "x-user")
            truth = top1(client, 0, version=1)[1]
            seen: dict[str, set[bool]] = {}
            for user in range(24):
                for _ in range(5):
                    status, index = top1(client, 0, **{"x-user": f"user-{user}"})
                    assert status == 200
                    seen.setdefault(f"user-{user}", set()).add(index != truth)
    finally:
        stop_server(server)
    assert all(len(versions) == 1 for versions in seen.values()), seen  # each user saw one version
    on_candidate = sum(1 for versions in seen.values() if True in versions)
    print(f"\nsticky canary at 0.5: {on_candidate} of 24 users on the candidate")
    assert 0 < on_candidate < 24


def test_a_candidate_that_raises_is_aborted_and_the_primary_keeps_serving(tmp_path: Path) -> None:
    config = "[faults]\nfail_after_batches = 0\nversions = [2]\n"
    server = _start(_repo(tmp_path / "repo", candidate="copy", config=config), tmp_path / "server.log")
    try:
        with server.client() as client:
            rollout(client, candidate=2, mode="canary", fraction=0.5, abort_min_samples=20)
            statuses = [top1(client, i % 40)[0] for i in range(120)]
            doc = wait_for(client, lambda d: d["state"] == "aborted")
            after = [top1(client, i)[0] for i in range(10)]
            versions = client.get("/v2/models/digits").json()["versions"]
    finally:
        stop_server(server)
    print(f"\nraising candidate: {doc['state']} ({doc['reason']}); live statuses {sorted(set(statuses))}")
    assert doc["state"] == "aborted" and "injected fault" in doc["reason"]
    assert set(statuses) == {200} and set(after) == {200}  # a canary's failures were answered by the primary
    assert versions == ["1"]  # the candidate was unloaded


def _load(client: httpx.Client, stop: threading.Event, statuses: list[int]) -> None:
    i = 0
    while not stop.is_set() and i < 2000:  # bounded
        statuses.append(top1(client, i % 40)[0])
        i += 1


@pytest.mark.parametrize("action", ["promote", "abort"])
def test_promote_and_abort_under_load_lose_nothing(permuted: launcher.RunningServer, action: str) -> None:
    with permuted.client() as client:
        truth = {i: top1(client, i, version=1)[1] for i in range(40)}
        rollout(client, candidate=2, mode="shadow", fraction=0.5, auto=False)
        stop, statuses, threads = threading.Event(), [[] for _ in range(4)], []  # type: list[list[int]]
        clients = [permuted.client() for _ in statuses]
        for c, s in zip(clients, statuses, strict=True):
            threads.append(threading.Thread(target=_load, args=(c, stop, s)))
            threads[-1].start()
        while sum(map(len, statuses)) < 100:
            time.sleep(0.01)
        before = sum(map(len, statuses))
        decided = rollout(client, action, reason="under load")
        while sum(map(len, statuses)) < before + 100:
            time.sleep(0.01)
        stop.set()
        for t in threads:
            t.join(30)
        for c in clients:
            c.close()
        served = client.get("/v2/models/digits").json()["versions"]
        after = top1(client, 0)[1]
    every = [s for part in statuses for s in part]
    print(f"\n{action} under load: {len(every)} requests, statuses {sorted(set(every))}")
    assert decided["state"] == ("promoted" if action == "promote" else "aborted")
    assert set(every) == {200}
    assert served == (["2"] if action == "promote" else ["1"])
    assert (after != truth[0]) == (action == "promote")


@pytest.mark.parametrize("action", ["abort", "promote"])
def test_a_decision_gives_back_what_the_version_leaving_held(permuted: launcher.RunningServer, action: str) -> None:
    """Both versions loaded with the model share its one memory charge: what closing the version leaving measurably
    freed comes off it (at most that version's share, half here), instead of staying charged for ever."""
    with permuted.client() as client:
        rollout(client, candidate=2, mode="shadow", fraction=1.0, auto=False)
        during = metric_value(permuted.url, "visionserve_device_resident_bytes")
        rollout(client, action, reason="done")
        after = metric_value(permuted.url, "visionserve_device_resident_bytes")
    print(f"\nboth versions loaded with the model, {action}: charged {during / 1e6:.1f} -> {after / 1e6:.1f} MB")
    assert during - during // 2 <= after < during


def test_a_restart_resumes_a_running_rollout_reset_and_keeps_a_decision(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "repo")
    server = _start(repo, tmp_path / "server1.log")
    try:
        with server.client() as client:
            rollout(client, candidate=2, mode="shadow", fraction=1.0, auto=False)
            for i in range(10):
                top1(client, i)
            done = wait_for(client, lambda d: d["comparison"]["samples"] + d["comparison"]["shed"] >= 10)
            assert done["comparison"]["samples"] > 0
    finally:
        stop_server(server)
    server = _start(repo, tmp_path / "server2.log")
    try:
        with server.client() as client:
            resumed = rollout(client)
            rollout(client, "promote", reason="after the restart")
    finally:
        stop_server(server)
    assert (resumed["state"], resumed["candidate"], resumed["comparison"]["samples"]) == ("running", 2, 0)
    assert "comparison reset" in (tmp_path / "server2.log").read_text()
    server = _start(repo, tmp_path / "server3.log")
    try:
        with server.client() as client:
            kept = rollout(client)
            versions = client.get("/v2/models/digits").json()["versions"]
            status, _ = top1(client, 0)
    finally:
        stop_server(server)
    assert kept["state"] == "none" and kept["serving"] == 2
    assert versions == ["2"] and status == 200  # the old primary is not loaded again


@pytest.mark.parametrize("action", ["abort", "promote"])
def test_a_candidate_written_after_start_is_loaded_alone_and_charged_to_the_budget(tmp_path: Path, action: str) -> None:
    repo = _repo(tmp_path / "repo")
    later = tmp_path / "v2"
    shutil.move(repo / "digits" / "2", later)  # as `train --export` writes it: after the server started
    server = launcher.start(repo, "--admin-token", ADMIN_TOKEN, "--memory-budget", "cpu=4GB", log=tmp_path / "log")
    try:
        with server.client() as client:
            before = metric_value(server.url, "visionserve_device_resident_bytes")
            refused = client.post("/v2/models/digits/rollout", json={"candidate": 2}, headers=ADMIN)
            shutil.move(later, repo / "digits" / "2")
            started = rollout(client, candidate=2, mode="shadow", fraction=1.0, auto=False)
            during = metric_value(server.url, "visionserve_device_resident_bytes")
            status, _ = top1(client, 0)
            rollout(client, action, reason="done")
            after = metric_value(server.url, "visionserve_device_resident_bytes")
            versions = client.get("/v2/models/digits").json()["versions"]
    finally:
        stop_server(server)
    print(
        f"\ncandidate loaded alone, {action}: charged {before / 1e6:.1f} -> {during / 1e6:.1f} -> {after / 1e6:.1f} MB"
    )
    assert refused.status_code == 404 and "no usable version 2" in refused.json()["error"]
    assert started["state"] == "running" and status == 200
    assert during > before
    # What stays charged is what the version staying holds. Aborted: the model's charge as before. Promoted: both
    # versions' charges less what closing the old primary measurably freed (at most its own charge); both stayed
    # charged before, the old primary's for ever.
    if action == "abort":
        assert after == before
    else:
        assert during - before <= after < during
    assert versions == (["1"] if action == "abort" else ["2"])
