"""Rollouts of a detector, judged on boxes, against a real server (service/engine/box_comparison.py): an image
agrees when the candidate's boxes match the primary's (same class, IoU >= 0.5) with F1 >= ``min_box_f1``. The
detector finds an image's bright rectangle exactly (tests/export/test_outside_detectors.py's rows, behind a uint8
input); version 2 is the same graph, version 3 answers every box moved by 20% of its size along both axes (IoU 0.47
with the original). A shadow rollout of 2 beside 1 is promoted; one of 3 beside 2 is aborted within 200 images."""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from service import launcher
from service.core.tasks.box_comparison import box_f1
from tests.export.test_outside_detectors import BrightRows
from tests.http.conftest import ADMIN_TOKEN, stop_server
from tests.http.test_detect import IN_H, IN_W, LABELS, encoded, upright

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


class Candidates(torch.nn.Module):
    """uint8 in, the bright-rectangle rows out, every box moved by ``shift`` of its width and height."""

    def __init__(self, shift: float) -> None:
        super().__init__()
        self.rows, self.shift = BrightRows(), shift

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.rows(x.float() / 255.0)
        size = rows[..., 2:4] - rows[..., 0:2]
        moved = rows[..., 0:4] + torch.cat([size, size], -1) * self.shift
        return torch.cat([moved, rows[..., 4:]], -1)


def version(root: Path, number: int, shift: float) -> None:
    folder = root / "bright" / str(number)
    folder.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            Candidates(shift).eval(), (torch.zeros(1, 3, IN_H, IN_W, dtype=torch.uint8),), str(folder / "model.onnx"),
            input_names=["input"], output_names=["candidates"], opset_version=17, dynamo=False,
            dynamic_axes={"input": {0: "batch"}, "candidates": {0: "batch"}},
        )  # fmt: skip
    spec = {
        "name": "bright", "architecture": "bright-rectangle", "task": "detect", "resize": "letterbox",
        "output_layout": "candidates", "input": {"height": IN_H, "width": IN_W}, "resize_size": IN_W,
        "mean": [0, 0, 0], "std": [1, 1, 1], "labels": list(LABELS),
    }  # fmt: skip
    (folder / "spec.json").write_text(json.dumps(spec))


def test_box_f1_matches_one_to_one_by_class_at_iou_half() -> None:
    a = np.array([[0, 0, 10, 10, 0.9, 1], [20, 20, 30, 30, 0.8, 2]], dtype=np.float32)
    assert box_f1(a, a)[0] == 1.0 and box_f1(a[:0], a[:0])[0] == 1.0 and box_f1(a, a[:0])[0] == 0.0
    moved = a.copy()
    moved[0, :4] += 2  # 8x8 of 10x10 overlapping: IoU 64/136 = 0.47, under 0.5
    f1, ious, shifts = box_f1(a, moved)
    assert f1 == pytest.approx(0.5) and len(ious) == 1 and shifts.tolist() == [0.0]
    relabelled = a.copy()
    relabelled[1, 5] = 0  # the same box of another class is no match
    assert box_f1(a, relabelled)[0] == pytest.approx(0.5)


def images() -> list[bytes]:
    """Rectangles of many places and sizes in a 96 x 72 image, each a different answer."""
    rng = np.random.default_rng(5)
    out = []
    for _ in range(40):
        x1, y1 = int(rng.integers(0, 50)), int(rng.integers(0, 36))
        out.append(encoded(upright(72, 96, (x1, y1, x1 + int(rng.integers(12, 40)), y1 + int(rng.integers(10, 30))))))
    return out


def decided(client: httpx.Client, pngs: list[bytes], most: int = 400) -> dict[str, Any]:
    """Detect requests, one image each, until the rollout leaves ``running`` (at most ``most``); its document."""
    doc: dict[str, Any] = {}
    for i in range(most):
        answer = client.post("/v1/models/bright/detect", content=pngs[i % len(pngs)],
                             headers={"content-type": "image/png"})  # fmt: skip
        assert answer.status_code == 200, answer.text
        doc = client.get("/v2/models/bright/rollout").json()
        if doc["state"] != "running":
            return doc
    return until(client, lambda d: d["state"] != "running")


def until(client: httpx.Client, done: Callable[[dict[str, Any]], bool], timeout_s: float = 10) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        doc: dict[str, Any] = client.get("/v2/models/bright/rollout").json()
        if done(doc) or time.monotonic() > deadline:
            return doc
        time.sleep(0.05)


def test_a_detectors_shadow_rollout_is_promoted_when_its_boxes_agree_and_aborted_when_they_move(
    tmp_path: Path,
) -> None:
    root = tmp_path / "repo"
    for number in (1, 2):
        version(root, number, 0.0)
    (root / "bright" / "config.toml").write_text("max_queue_delay_ms = 0\n")
    server = launcher.start(root, "--admin-token", ADMIN_TOKEN, log=tmp_path / "server.log", ready_timeout_s=120)
    policy = {"mode": "shadow", "fraction": 1.0, "min_samples": 60, "min_agreement": 0.9, "abort_min_samples": 50,
              "max_latency_ratio": 100}  # fmt: skip
    pngs = images()
    try:
        with server.client() as client:
            started = client.post("/v2/models/bright/rollout", json={"candidate": 2, **policy}, headers=ADMIN)
            assert started.status_code == 200, started.text
            assert (started.json()["primary"], started.json()["comparison"]["measure"]) == (
                1, "images whose boxes' F1 against the primary's (same class, IoU >= 0.5) >= 0.9"
            )  # fmt: skip
            same = decided(client, pngs)
            version(root, 3, 0.2)  # written now, loaded by its rollout's start: the serving one is 2
            moved_start = client.post("/v2/models/bright/rollout", json={"candidate": 3, **policy}, headers=ADMIN)
            assert moved_start.status_code == 200 and moved_start.json()["primary"] == 2, moved_start.text
            moved = decided(client, pngs)
    finally:
        stop_server(server)
    compared = same["comparison"]
    print(f"\nidentical: {same['state']} after {compared['samples']} compared ({same['reason']}); moved: "
          f"{moved['state']} after {moved['comparison']['samples']} ({moved['reason']})")  # fmt: skip
    assert same["state"] == "promoted" and compared["agreed"] == compared["samples"] >= 60
    assert compared["box_f1_mean"] == 1.0 and compared["box_iou"]["counts"][-1] == compared["box_iou"]["pairs"] > 0
    assert "box agreement" in same["reason"]
    assert moved["state"] == "aborted" and 50 <= moved["comparison"]["samples"] <= 200
    assert moved["comparison"]["agreed"] == 0 and "box agreement 0/" in moved["reason"]
