"""The AOTInductor package served over HTTP by the real server process (started with the CLI), on the CPU."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch

from export.sources import from_checkpoint
from models.datasets import load_dataset
from service.core.preprocess import preprocess_image
from service.core.repository import ModelRepository
from tests.conftest import encode_image
from tests.http.conftest import start_server, stop_server


def test_the_server_classifies_with_the_aoti_package_as_eager_does(
    aoti_repo: Path, digits_checkpoint: Path, tmp_path: Path
) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(aoti_repo / "digits", repo / "digits")
    (repo / "digits" / "config.toml").write_text('backend = "aoti"\ndevice = "cpu"\nmax_batch_size = 8\n')
    spec = ModelRepository(repo).model("digits").latest.spec
    data = load_dataset("digits", spec)
    chw = data.val_images.numpy()[:6]
    files = [encode_image(np.ascontiguousarray(x.transpose(1, 2, 0)), "PNG") for x in chw]
    eager = from_checkpoint(digits_checkpoint).eager
    with torch.inference_mode():
        expected = eager(torch.from_numpy(np.stack([preprocess_image(f, spec) for f in files]))).argmax(1).tolist()

    server = start_server(repo, tmp_path / "server.log")
    try:
        with server.client() as client:
            meta = client.get("/v2/models/digits").json()
            assert meta["parameters"]["backend"] == "aoti", meta
            got = []
            for data_bytes in files:
                r = client.post(
                    "/v1/models/digits/classify?top_k=1", content=data_bytes, headers={"Content-Type": "image/png"}
                )
                assert r.status_code == 200, r.text
                got.append(r.json()["results"][0]["predictions"][0]["index"])
    finally:
        stop_server(server)
    assert got == expected
