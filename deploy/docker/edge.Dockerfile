# An OpenAI-compatible edge: `hybridspec edge serve` on port 8000 (HTTP API, /health, /metrics).
# Build from the repository root:
#   docker build -f deploy/docker/edge.Dockerfile -t hybridspec-edge .
#   docker run -p 8000:8000 -v $PWD/edge-tls:/etc/hybridspec/tls:ro -e HYBRIDSPEC_TOKEN=hs_... \
#     hybridspec-edge --cloud CLOUD_HOST:50051 --tls --http-tls-cert /etc/hybridspec/tls/tls.crt \
#     --http-tls-key /etc/hybridspec/tls/tls.key --api-keys /etc/hybridspec/tls/api-keys.yaml
# The cloud address is the one argument the image cannot know: pass --cloud HOST:PORT (compose.yaml
# gives netem:50052). The embedded drafter is pulled at build time (it shares the target's files).
FROM python:3.11.14-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HYBRIDSPEC_HOME=/home/hybridspec/.cache/hybridspec

RUN pip install "pip==25.2" \
 && pip install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu

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
# llama-cpp-python (pyproject.toml) compiles llama.cpp: a compiler and CMake for this step only, and a
# portable build (AVX2, not -march=native: the image runs on other hosts than the one that builds it).
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential cmake \
 && CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_OPENMP=OFF -DLLAVA_BUILD=OFF" \
    pip install /src \
 && apt-get purge -y build-essential cmake && apt-get autoremove -y && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 10001 hybridspec
USER hybridspec
WORKDIR /home/hybridspec
RUN hybridspec models pull

EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health/ready', timeout=3)"]
ENTRYPOINT ["hybridspec", "edge", "serve", "--host", "0.0.0.0", "--port", "8000"]
