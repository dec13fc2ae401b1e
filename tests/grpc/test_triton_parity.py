"""The last differences from Triton (2.51) that existing v2 tools trip on, over HTTP and gRPC against one real server:
an unload of a name the repository does not hold, the ready-only repository index, the raw binary request
(``Inference-Header-Content-Length: 0``), statistics with every key Triton's have, and scalar metadata parameters."""

from __future__ import annotations

import json
from typing import Any

import httpx
import numpy as np
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp

from service.core.protocol import method_path, pb
from tests.grpc.conftest import ADMIN_TOKEN, GrpcServer
from tests.grpc.test_grpc import eventually
from tests.http.test_image_api import digit_png

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
ADMIN = (("authorization", f"Bearer {ADMIN_TOKEN}"),)
PIXELS = np.random.default_rng(5).integers(0, 256, (1, 3, 32, 32), dtype=np.uint8)
RAW = {"Inference-Header-Content-Length": "0"}


def rpc(both: GrpcServer, name: str, request: Any, response: Any) -> Any:
    """One RPC over a bare channel (what tritonclient cannot send, or reads past), as an admin."""
    with both.channel() as channel:
        call = channel.unary_unary(
            method_path(name), request_serializer=request.SerializeToString, response_deserializer=response.FromString
        )
        return call(request, metadata=ADMIN, timeout=30)


# ---- repository ---------------------------------------------------------------------------------------------------


def test_unloading_a_model_the_repository_does_not_hold_is_ok(both: GrpcServer) -> None:
    """Triton answers 200 (idempotent scripts); it was 404 here."""
    with httpx.Client(base_url=both.http.url, timeout=30) as c:
        for _ in range(2):
            r = c.post("/v2/repository/models/nope/unload", headers=AUTH)
            assert (r.status_code, r.json()) == (200, {"name": "nope", "state": "UNAVAILABLE"}), r.text
        assert c.post("/v2/repository/models/nope/unload").status_code == 403  # still admin only
        assert c.get("/v2/models/digits/ready").status_code == 200
    tgrpc.InferenceServerClient(both.target).unload_model("nope", headers=dict(ADMIN))  # raises on any error
    answer = rpc(both, "RepositoryModelUnload", pb.RepositoryModelUnloadRequest(model_name="nope"),
                 pb.RepositoryModelUnloadResponse)  # fmt: skip
    assert isinstance(answer, pb.RepositoryModelUnloadResponse)


def test_the_repository_index_lists_only_ready_models_when_asked(both: GrpcServer) -> None:
    with httpx.Client(base_url=both.http.url, timeout=30) as c:
        assert c.post("/v2/repository/models/digits2/unload", headers=AUTH).status_code == 200
        try:
            everything = c.post("/v2/repository/index", headers=AUTH).json()
            ready = c.post("/v2/repository/index", headers=AUTH, json={"ready": True}).json()
            assert c.post("/v2/repository/index", headers=AUTH, json={"ready": False}).json() == everything
            over_grpc = rpc(both, "RepositoryIndex", pb.RepositoryIndexRequest(ready=True), pb.RepositoryIndexResponse)
            all_grpc = rpc(both, "RepositoryIndex", pb.RepositoryIndexRequest(), pb.RepositoryIndexResponse)
            for body, message in [({"ready": 1}, "ready must be true or false, got 1"),
                                  ([True], "must be a JSON object"), (b"{", "must be a JSON object")]:  # fmt: skip
                kw: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
                r = c.post("/v2/repository/index", headers=AUTH, **kw)
                assert r.status_code == 400 and message in r.json()["error"], r.text
        finally:
            assert c.post("/v2/repository/models/digits2/load", headers=AUTH).status_code == 200
        assert eventually(lambda: c.get("/v2/models/digits2/ready").status_code == 200)
    assert {"name": "digits2", "state": "UNAVAILABLE", "reason": "unloaded by request"} in everything
    assert ready and all(row["state"] == "READY" for row in ready), ready
    assert {"name": "digits", "version": "1", "state": "READY"} in ready and "digits2" not in {r["name"] for r in ready}
    assert [m.name for m in over_grpc.models] == [r["name"] for r in ready]
    assert {(m.name, m.state) for m in all_grpc.models} == {(r["name"], r["state"]) for r in everything}


# ---- the raw binary request ---------------------------------------------------------------------------------------


def binary_answer(r: httpx.Response) -> tuple[dict[str, Any], np.ndarray]:
    """(JSON header, LOGITS) of an answer whose outputs are binary, as Triton answers a raw request."""
    assert r.status_code == 200, r.text
    n = int(r.headers["Inference-Header-Content-Length"])
    return json.loads(r.content[:n]), np.frombuffer(r.content[n:], dtype="<f4").reshape(1, 10)


def test_a_raw_binary_request_is_the_body_as_the_one_input(both: GrpcServer) -> None:
    """Header length 0, as Triton's http_server.cc reads it: no JSON; the body is the model's one input, batch 1;
    the outputs come back binary. For ``m.image`` that is one image file, for ``m`` one image's UINT8 pixels."""
    png = digit_png(3)[0]
    client = thttp.InferenceServerClient(both.http.url.removeprefix("http://"))
    image = thttp.InferInput("IMAGE", [1], "BYTES")
    image.set_data_from_numpy(np.array([png], dtype=np.object_))
    pixels = thttp.InferInput("INPUT", list(PIXELS.shape), "UINT8")
    pixels.set_data_from_numpy(PIXELS)
    with httpx.Client(base_url=both.http.url, timeout=30) as c:
        head, logits = binary_answer(c.post("/v2/models/digits.image/infer", content=png, headers=RAW))
        logits_out = {"name": "LOGITS", "datatype": "FP32", "shape": [1, 10], "parameters": {"binary_data_size": 40}}
        assert head == {"model_name": "digits", "model_version": "1", "outputs": [logits_out]}
        np.testing.assert_allclose(logits, client.infer("digits.image", [image]).as_numpy("LOGITS"), rtol=1e-5)

        _, logits = binary_answer(c.post("/v2/models/digits/infer", content=PIXELS.tobytes(), headers=RAW))
        np.testing.assert_allclose(logits, client.infer("digits", [pixels]).as_numpy("LOGITS"), rtol=1e-5)

        short = c.post("/v2/models/digits/infer", content=PIXELS.tobytes()[:-1], headers=RAW)
        assert short.status_code == 400 and "shape [1, 3, 32, 32]: 3072 bytes, got 3071" in short.json()["error"]
        junk = c.post("/v2/models/digits.image/infer", content=b"not an image", headers=RAW)
        assert junk.status_code == 400 and junk.json()["error"].startswith("image 0:")


# ---- statistics and metadata --------------------------------------------------------------------------------------

INFERENCE_STATS = {"success", "fail", "queue", "compute_input", "compute_infer", "compute_output", "cache_hit",
                   "cache_miss"}  # fmt: skip
BATCH_STATS = {"compute_input", "compute_infer", "compute_output"}


def test_statistics_carry_every_key_triton_has(both: GrpcServer) -> None:
    client = tgrpc.InferenceServerClient(both.target)
    tensor = tgrpc.InferInput("INPUT", list(PIXELS.shape), "UINT8")
    tensor.set_data_from_numpy(PIXELS)
    client.infer("digits", [tensor])  # at least one batch, so batch_stats has an entry
    http = httpx.get(both.http.url + "/v2/models/digits/stats", timeout=30).json()["model_stats"][0]
    assert {"name", "version", "last_inference", "inference_count", "execution_count", "inference_stats",
            "batch_stats", "memory_usage", "response_stats"} <= set(http)  # fmt: skip
    assert set(http["inference_stats"]) == INFERENCE_STATS
    assert all(set(d) == {"count", "ns"} for d in http["inference_stats"].values())
    assert http["inference_stats"]["cache_hit"] == http["inference_stats"]["cache_miss"] == {"count": 0, "ns": 0}
    assert http["batch_stats"] and all(set(b) == {"batch_size", *BATCH_STATS} for b in http["batch_stats"])
    assert http["memory_usage"] == [] and http["response_stats"] == {}

    # gRPC: proto3 leaves a zero StatisticDuration out of the bytes unless it is set; each is set, so a tool that
    # reads them (tritonclient's as_json included) finds every key.
    stats = rpc(both, "ModelStatistics", pb.ModelStatisticsRequest(name="digits"), pb.ModelStatisticsResponse)
    row = stats.model_stats[0]
    assert all(row.inference_stats.HasField(key) for key in INFERENCE_STATS)
    assert row.batch_stats and all(b.HasField(key) for b in row.batch_stats for key in BATCH_STATS)
    as_json = client.get_inference_statistics("digits", as_json=True)["model_stats"][0]
    assert set(as_json["inference_stats"]) == INFERENCE_STATS


def test_metadata_parameters_are_scalars_as_the_v2_spec_has_them(both: GrpcServer) -> None:
    with httpx.Client(base_url=both.http.url, timeout=30) as c:
        params = c.get("/v2/models/digits").json()["parameters"]
        listed = {m["name"]: m for m in c.get("/v1/models").json()}["digits"]
    assert set(params) == {"state", "state_reason", "backend", "devices", "precision", "ungated", "fallbacks",
                           "replaced", "residency", "resident", "resident_bytes", "why_not_resident",
                           "labels"}  # fmt: skip
    assert all(isinstance(v, str | int | float | bool) for v in params.values()), params
    # The same information as before, flattened: the page's model list reads the same engine state.
    assert params["state"] == listed["state"] == "READY" and params["devices"] == listed["device"]
    assert params["state_reason"] == (listed["note"] or "") and params["backend"] == listed["backend"]
    assert params["precision"] == listed["precision"] and params["ungated"] is False and params["labels"] == 10
    assert params["fallbacks"] == 0 and params["replaced"] == 0
    assert params["residency"] == listed["residency"] == "pinned" and params["resident"] is listed["resident"] is True
    assert params["resident_bytes"] == listed["resident_bytes"] > 0 and params["why_not_resident"] == ""
