# visionserve on a CUDA runtime image, as the KServe ServingRuntime (deploy/kserve/servingruntime.yaml) and a Ray
# Serve cluster (deploy/ray/serve.yaml) run it. Build from the repository root:
#
#   docker build -t visionserve:0.1.0 .
#   docker run --gpus all -p 8080:8080 -v "$PWD/model_repository:/mnt/models:ro" --shm-size 1g visionserve:0.1.0
#
# The CUDA libraries torch and onnxruntime-gpu use come with their wheels (the nvidia-* packages in
# constraints.txt are CUDA 13 builds: torch 2.14.1+cu130, cuDNN 9 for CUDA 13); the base image is CUDA 13's
# runtime, the same major, so nothing in it contradicts them, and the container toolkit mounts the driver.
# Dockerfile.cpu is the image with no CUDA and no torch at all (the serving install: ONNX on onnxruntime's CPU build).
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Python 3.11, the version constraints.txt is resolved and tested for (Ubuntu 24.04 ships 3.12). Apt versions are
# not pinned: the CUDA image and the PPA move together, and constraints.txt pins everything Python.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends software-properties-common gpg-agent \
 && add-apt-repository -y ppa:deadsnakes/ppa \
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv libgomp1 \
 && apt-get purge -y software-properties-common gpg-agent \
 && apt-get autoremove -y \
 && rm -rf /var/lib/apt/lists/*

RUN python3.11 -m venv /opt/venv \
 && useradd --create-home --uid 1000 --user-group --shell /usr/sbin/nologin visionserve
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /opt/visionserve
COPY pyproject.toml constraints.txt README.md ./
COPY service ./service
COPY models ./models
COPY export ./export
COPY loadtest ./loadtest
COPY deploy ./deploy
# The exact versions the project is tested with: onnxruntime's CUDA build (`gpu`), the torch runtimes (`torch`:
# TorchScript, AOTInductor, GPU JPEG decoding), `fast` (uvloop, httptools) and `ray` (the Ray Serve deployment).
RUN pip install -c constraints.txt ".[gpu,torch,fast,ray]"

USER 1000:1000
EXPOSE 8080 8081
HEALTHCHECK --interval=10s --timeout=3s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8080/v2/health/ready', timeout=2).status != 200)"]
ENTRYPOINT ["visionserve"]
CMD ["serve", "--repository", "/mnt/models", "--host", "0.0.0.0", "--port", "8080", "--grpc-port", "8081"]
