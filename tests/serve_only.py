"""What a user does with the serving install alone (``make test-serve-only``: .venv-serve, no torch, no pytest).

Run by the serving install's own interpreter, it checks, against real servers started as ``make serve`` starts one:

- torch does not import here, and the commands that need it say which extra installs it (exit 2, no traceback);
- the shipped default model serves: the README's image classified over HTTP, over gRPC (IMAGE bytes, the
  classification extension), ``/metrics``, the demo page and the OpenAPI UI's assets;
- the shipped detector serves: the README's canvas answered with its digits;
- a model with a broken ``model.pt`` beside its ``model.onnx`` serves from the ONNX one;
- a model whose load raises is reported (its 404 names why, ``/metrics`` counts it) while the others serve, and
  ``--strict-readiness`` holds readiness false meanwhile.

Prints one line per check and the time each server took to be ready; exits 1 at the first failed check.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The checkout first; and not tests/ (this script's folder, which Python put first): tests/http shadows http.
sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p or ".").resolve() != ROOT / "tests")]

import grpc  # noqa: E402  (the checkout first on the path)
import httpx  # noqa: E402

from service import launcher  # noqa: E402
from service.core.protocol import method_path, pb  # noqa: E402

SHIPPED = ROOT / "examples" / "model_repository" / "digits"
IMAGE = (ROOT / "examples" / "digit-3.png").read_bytes()
CANVAS = (ROOT / "examples" / "digits-canvas.png").read_bytes()
CANVAS_DIGITS = ["3", "7", "8"]  # what the README's canvas holds (its labels, sorted)


def check(what: str, ok: bool, detail: object = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {what}" + (f": {detail}" if detail and not ok else ""), flush=True)
    if not ok:
        raise SystemExit(1)


def no_torch() -> None:
    done = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, text=True)
    check("torch does not import in the serving install", done.returncode != 0, done.stdout)
    for args, extra in (
        (["train", "--epochs", "1"], "train"),
        (["models"], "torch"),
        (["export", "--arch", "smallcnn", "--name", "x"], "train"),
    ):
        done = subprocess.run([sys.executable, "-m", "service.cli", *args], capture_output=True, text=True, cwd=ROOT)
        said = done.stderr.strip()
        check(f"`visionserve {args[0]}` names the '{extra}' extra", done.returncode == 2 and f"'{extra}'" in said
              and "Traceback" not in said, said[-500:])  # fmt: skip


def repository(root: Path) -> Path:
    shutil.copytree(SHIPPED, root / "digits")
    shutil.copytree(SHIPPED.parent / "digits-detect", root / "digits-detect")
    shutil.copytree(SHIPPED.parent / "digits-segment", root / "digits-segment")
    shutil.copytree(SHIPPED, root / "spare")  # a broken TorchScript file beside the ONNX one
    (root / "spare" / "1" / "model.pt").write_bytes(b"PK\x03\x04 not a TorchScript archive")
    shutil.copytree(SHIPPED, root / "broken")  # its load raises (a runtime's own exception)
    (root / "broken" / "config.toml").write_text('[faults]\nload_error = "libcudnn.so.9: cannot open shared object"\n')
    return root


def grpc_top1(target: str) -> str:
    request = pb.ModelInferRequest(model_name="digits.image")
    request.inputs.add(name="IMAGE", datatype="BYTES", shape=[1]).contents.bytes_contents.append(IMAGE)
    request.outputs.add(name="LOGITS").parameters["classification"].int64_param = 1
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary(method_path("ModelInfer"), request_serializer=pb.ModelInferRequest.SerializeToString,
                                   response_deserializer=pb.ModelInferResponse.FromString)  # fmt: skip
        response = call(request, timeout=60)
    raw = response.raw_output_contents[0]  # one BYTES element: 4-byte length, then "score:index:label"
    return raw[4:].decode().rsplit(":", 1)[1]


def serving(root: Path, log: Path) -> None:
    started = time.perf_counter()
    with launcher.start(root, log=log, grpc_port=0) as server:
        print(f"     ready {time.perf_counter() - started:.1f} s after start", flush=True)
        url = server.url
        answer = httpx.post(f"{url}/v1/models/digits/classify?top_k=3", content=IMAGE,
                            headers={"Content-Type": "image/png"}, timeout=60)  # fmt: skip
        top = answer.json()["results"][0]["predictions"][0] if answer.status_code == 200 else {}
        check("the shipped model classifies the README's image over HTTP", top.get("label") == "3", answer.text)
        check("... and over gRPC", grpc_top1(server.grpc_target) == "3")
        boxes = httpx.post(f"{url}/v1/models/digits-detect/detect", content=CANVAS,
                           headers={"Content-Type": "image/png"}, timeout=60)  # fmt: skip
        found = boxes.json()["results"][0]["detections"] if boxes.status_code == 200 else []
        check("the shipped detector finds the README canvas's digits",
              sorted(d["label"] for d in found) == CANVAS_DIGITS, boxes.text)  # fmt: skip
        masks = httpx.post(f"{url}/v1/models/digits-segment/segment", content=CANVAS,
                           headers={"Content-Type": "image/png"}, timeout=60)  # fmt: skip
        outlined = masks.json()["results"][0]["instances"] if masks.status_code == 200 else []
        check("the shipped segmenter outlines them, each mask COCO's RLE of the canvas (no torch here)",
              sorted(i["label"] for i in outlined) == CANVAS_DIGITS
              and all(i["mask"]["size"] == [192, 288] and i["area"] > 0 for i in outlined), masks.text)  # fmt: skip
        spare = httpx.post(f"{url}/v1/models/spare/classify", content=IMAGE, headers={"Content-Type": "image/png"})
        meta = httpx.get(f"{url}/v2/models/spare").json()
        check("a broken model.pt beside model.onnx: served from the ONNX one", spare.status_code == 200
              and meta.get("platform") == "onnxruntime_onnx", meta)  # fmt: skip
        broken = httpx.get(f"{url}/v2/models/broken")
        check("a model whose load raised: its 404 says why", broken.status_code == 404
              and "RuntimeError: injected load failure: libcudnn" in broken.text, broken.text)  # fmt: skip
        metrics = httpx.get(f"{url}/metrics").text
        check("/metrics counts requests and the failed load", 'visionserve_requests_total{' in metrics
              and 'visionserve_model_load_failures_total{model="broken",version="1"} 1.0' in metrics)  # fmt: skip
        page = httpx.get(url + "/")
        docs = httpx.get(url + "/docs", follow_redirects=True)
        assets = [a for a in docs.text.split('"') if a.endswith((".js", ".css", ".png")) and "//" not in a]
        codes = [httpx.get(httpx.URL(str(docs.url)).join(a)).status_code for a in assets]
        loaded = page.status_code == docs.status_code == 200 and bool(assets) and set(codes) == {200}
        check("the demo page and the OpenAPI UI's assets load", loaded, (page.status_code, docs.status_code, codes))
        ready = httpx.get(url + "/v2/health/ready").json()
        check("not strict: ready with what loaded", ready == {"ready": True}, ready)
        streamed = stream_one(url)
        check("a frame streamed over the WebSocket is classified", streamed.get("status") == "result"
              and streamed["predictions"][0]["label"] == "3", streamed)  # fmt: skip


def stream_one(url: str) -> dict[str, object]:
    """One frame over ``/v1/models/digits/stream`` (docs/streams.md): uvicorn serves WebSockets only when the
    serving install has a WebSocket library."""
    from websockets.sync.client import connect

    header = json.dumps({"id": 1}).encode()
    with connect(url.replace("http://", "ws://") + "/v1/models/digits/stream", proxy=None) as ws:
        ws.send(struct.pack(">I", len(header)) + header + IMAGE)
        return dict(json.loads(ws.recv(timeout=30)))


def serves(url: str) -> bool:
    try:
        answer = httpx.post(f"{url}/v1/models/digits/classify", content=IMAGE, headers={"Content-Type": "image/png"})
    except httpx.TransportError:
        return False
    return answer.status_code == 200


def strict(root: Path, log: Path) -> None:
    server = launcher.launch(root, "--strict-readiness", log=log)
    try:
        try:  # digits answers (readiness cannot tell, by design)
            launcher.wait_until(server, lambda: serves(server.url), 120, "serving digits")
        except RuntimeError as exc:
            check("the strict server answers", False, exc)
        ready = httpx.get(server.url + "/v2/health/ready")
        check("--strict-readiness: not ready while a model failed to load",
              (ready.status_code, ready.json()) == (400, {"ready": False}), ready.text)  # fmt: skip
    finally:
        code = launcher.stop(server)
    check("... and it drains and exits 0", code == 0, code)


def main() -> int:
    no_torch()
    with tempfile.TemporaryDirectory(prefix="serve-only-") as tmp:
        root = repository(Path(tmp) / "repo")
        serving(root, Path(tmp) / "server.log")
        strict(root, Path(tmp) / "strict.log")
    print(json.dumps({"serve_only": "passed", "python": sys.executable}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
