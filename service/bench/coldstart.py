"""``bench many-models``: the cold start of one model in parts: the project's runtime in this process, the first
request to a server, and Triton's explicit load of the same file."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import httpx

from loadtest.mix import cold_start_ms
from service import launcher


def cold_in_process(version: Path, max_batch_size: int, repeats: int) -> dict[str, Any]:
    """The project's runtime loading ``version`` here: read the file, build the session (``OnnxRuntime``),
    warm up every bucket; the first load (which also starts onnxruntime in this process) apart from the rest."""
    from service.core.spec import load_spec
    from service.runtime import warm_up
    from service.runtime.onnxrt import OnnxRuntime

    spec = load_spec(version / "spec.json")
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        size = len((version / "model.onnx").read_bytes())  # from the page cache: the file was just written or read
        t1 = time.perf_counter()
        runtime = OnnxRuntime(spec, version / "model.onnx", name="cold")
        t2 = time.perf_counter()
        warm_up(runtime, max_batch_size)
        t3 = time.perf_counter()
        runtime.close()
        parts = {"read_ms": t1 - t0, "build_ms": t2 - t1, "warmup_ms": t3 - t2, "total_ms": t3 - t0}
        runs.append({k: 1000 * seconds for k, seconds in parts.items()})
    later = runs[1:] or runs
    median = {k: statistics.median(r[k] for r in later) for k in runs[0]}
    return {"file_bytes": size, "first": runs[0], "median_later": median, "runs": runs}


def cold_served(server: launcher.RunningServer, model: str, body: bytes) -> dict[str, Any]:
    """The first request to on-demand ``model``: its latency and the server's ``cold_start``, then a second one."""
    figures: dict[str, Any] = {}
    for which in ("first", "second"):
        started = time.perf_counter()
        url = f"{server.url}/v1/models/{model}/classify"
        r = httpx.post(url, content=body, headers={"Content-Type": "image/jpeg"}, timeout=120)
        r.raise_for_status()
        figures[f"{which}_request_ms"] = 1000 * (time.perf_counter() - started)
        figures[f"{which}_cold_start_ms"] = cold_start_ms(r.headers.get("server-timing"))
    return figures


TRITON_MODEL = """\
import sys
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        sys.path.append("{site}")  # the stub is an isolated interpreter: onnxruntime from visionserve's venv
        import numpy as np
        import onnxruntime as ort

        t0 = time.perf_counter()
        self.session = ort.InferenceSession("{onnx}", providers=["CPUExecutionProvider"])
        t1 = time.perf_counter()
        for n in {buckets}:
            self.session.run(None, {{"{input}": np.zeros((n, 3, {size}, {size}), np.uint8)}})
        t2 = time.perf_counter()
        print(f"visionserve-bench build_ms={{1000 * (t1 - t0):.1f}} warmup_ms={{1000 * (t2 - t1):.1f}}", flush=True)

    def execute(self, requests):
        return [pb_utils.InferenceResponse(output_tensors=[]) for _ in requests]
"""


def triton_load(args: argparse.Namespace, version: Path, work: Path) -> dict[str, Any]:
    """Triton 2.51 (the peers kit's, Python backend) started with explicit model control, then the timed
    ``POST /v2/repository/models/cold/load`` of the same ONNX file: a session build and the same warm-up."""
    if not args.triton:
        return {"ran": False, "why": "not asked (--triton)"}
    peers = Path(args.peers_home)
    found = sorted((peers / ".venv-triton").glob("lib/python3*/site-packages/pytriton/tritonserver"))
    if not found:
        return {"ran": False, "why": f"no Triton under {peers}/.venv-triton: run ../shared/peers/peers.sh setup"}
    tdir = found[-1]
    run = (work / "triton").resolve()  # tritonserver runs in it: every path it is given must be absolute
    _triton_folder(run, tdir, version, args.cold_max_batch_size)
    libraries = [sysconfig.get_config_var("LIBDIR"), str(tdir.parents[1] / "nvidia_pytriton.libs")]
    env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(libraries))
    env["PATH"] = os.pathsep.join([str(peers / ".venv-triton" / "bin"), env.get("PATH", "")])
    port = launcher.free_port()
    log = (run / "triton.log").open("wb")
    where = [f"--model-repository={run / 'models'}", f"--backend-directory={run / 'backends'}", f"--http-port={port}"]
    fixed = "--model-control-mode=explicit --http-address=127.0.0.1 --allow-grpc=false --allow-metrics=false"
    command = [str(tdir / "bin" / "tritonserver"), *where, *fixed.split(), "--exit-timeout-secs=5"]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=run, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/v2/health/live", timeout=1).status_code == 200:
                    break
            if process.poll() is not None:
                return {"ran": False, "why": f"tritonserver exited {process.returncode}: see {run / 'triton.log'}"}
            time.sleep(0.1)
        started = time.perf_counter()
        r = httpx.post(url + "/v2/repository/models/cold/load", timeout=120)
        load_ms = 1000 * (time.perf_counter() - started)
        if r.status_code != 200:
            return {"ran": False, "why": f"the load answered {r.status_code}: {r.text[:300]}"}
        lines = (run / "triton.log").read_text(errors="replace").splitlines()
        parts = [line for line in lines if "visionserve-bench" in line]
        figures = dict(kv.split("=") for kv in parts[-1].split()[1:]) if parts else {}
        return {"ran": True, "load_ms": load_ms, **{k: float(v) for k, v in figures.items()}}
    finally:
        launcher.stop_process(process, timeout_s=10)  # the stub, its child, with it
        log.close()


def _triton_folder(run: Path, tdir: Path, version: Path, max_batch_size: int) -> None:
    """Triton's model repository (a Python model timing its session's build and warm-up) and backends in ``run``."""
    pyver = f"{sys.version_info.major}.{sys.version_info.minor}"
    shutil.rmtree(run, ignore_errors=True)
    import onnx

    from service.core.spec import load_spec
    from service.runtime import bucket_sizes

    spec = load_spec(version / "spec.json")
    graph_input = onnx.load(str(version / "model.onnx"), load_external_data=False).graph.input[0].name
    (run / "models" / "cold" / "1").mkdir(parents=True)
    (run / "models" / "cold" / "1" / "model.py").write_text(
        TRITON_MODEL.format(
            onnx=(version / "model.onnx").resolve(),
            buckets=list(bucket_sizes(max_batch_size)),
            input=graph_input,
            size=spec.input.height,
            site=sysconfig.get_paths()["purelib"],
        )
    )
    (run / "models" / "cold" / "config.pbtxt").write_text(
        'name: "cold"\nbackend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "IMAGE" data_type: TYPE_UINT8 dims: [ -1 ] } ]\n'
        'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
        "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
    )
    backends = run / "backends" / "python"
    backends.mkdir(parents=True)
    for f in ("libtriton_python.so", "triton_python_backend_utils.py"):
        shutil.copy2(tdir / "backends" / "python" / f, backends / f)
    shutil.copy2(tdir / "python_backend_stubs" / pyver / "triton_python_backend_stub", backends)
