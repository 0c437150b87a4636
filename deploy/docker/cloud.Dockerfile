# The cloud verifier pool on an NVIDIA GPU: `hybridspec cloud serve` (gRPC 50051, /metrics 9464).
# Build from the repository root and run with the NVIDIA container toolkit:
#   docker build -f deploy/docker/cloud.Dockerfile -t hybridspec-cloud:cuda .
#   docker run --gpus all --shm-size 2g -p 50051:50051 -p 127.0.0.1:9464:9464 \
#     -v $PWD/tls:/etc/hybridspec/tls:ro -v $PWD/credentials.yaml:/etc/hybridspec/credentials.yaml:ro \
#     hybridspec-cloud:cuda --replicas 1 --tls-cert /etc/hybridspec/tls/tls.crt \
#     --tls-key /etc/hybridspec/tls/tls.key --credentials /etc/hybridspec/credentials.yaml
# (docs/security.md makes the certificate and the credentials file.)
# torch's cu128 wheels bring their own CUDA libraries; the base image supplies the user-space driver
# hooks. The embedded models are pulled at build time; nothing is downloaded at run time.
FROM nvidia/cuda:12.8.1-runtime-ubuntu22.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HYBRIDSPEC_HOME=/home/hybridspec/.cache/hybridspec \
    PATH=/opt/venv/bin:$PATH

# gcc and the Python headers stay at run time: Triton (the GPU engine's kernels, cloud/engine/triton_ops.py)
# compiles its small kernel launcher with them the first time a replica starts.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev gcc libc6-dev ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3.11 -m venv /opt/venv

RUN pip install "pip==25.2" \
 && pip install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cu128

WORKDIR /src
COPY pyproject.toml README.md ./
COPY common common
COPY edge edge
COPY cloud cloud
COPY cli cli
COPY distill distill
COPY netem netem
COPY lab lab
COPY fetch fetch
# torch is already installed and satisfies pyproject's range, so pip keeps the CUDA build.
# llama-cpp-python (pyproject.toml) compiles llama.cpp: a compiler and CMake for this step only, and a
# portable build (AVX2, not -march=native: the image runs on other hosts than the one that builds it).
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential cmake \
 && CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_OPENMP=OFF -DLLAVA_BUILD=OFF" \
    pip install /src \
 && apt-get purge -y build-essential cmake && apt-get autoremove -y && rm -rf /var/lib/apt/lists/*
COPY deploy/docker/cloud.yaml /etc/hybridspec/cloud.yaml

RUN useradd --create-home --uid 10001 hybridspec
USER hybridspec
WORKDIR /home/hybridspec
RUN hybridspec models pull

EXPOSE 50051 9464
# Readiness over the metrics port: plain HTTP on loopback, so the check keeps working when the
# gRPC front door is TLS-only and needs a token.
HEALTHCHECK --interval=10s --timeout=5s --start-period=180s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9464/health/ready', timeout=3)"]
# Listening on every interface needs TLS (--tls-cert/--tls-key) or an explicit --insecure.
ENTRYPOINT ["hybridspec", "cloud", "serve", "--config", "/etc/hybridspec/cloud.yaml", "--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9464", "--device", "cuda", "--no-direct-verify"]
