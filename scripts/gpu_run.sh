#!/usr/bin/env bash
# The prepared GPU run (docs/gpu.md, "The prepared run"): every goal row of issue 53 in one command of
# at most 6 minutes, on a lent GPU machine that has torch, Triton, transformers and grpcio but no registry,
# no Ray and no llama-cpp-python. Run from the repository's root there:
#     HYBRIDSPEC_COMMIT=<commit> bash scripts/gpu_run.sh "$OUT" [more bench/gpu_suite.py flags]
# Wheels in .whl/ (protobuf, grpcio with its health-checking, reflection and status packages; see
# docs/gpu.md) are installed into /tmp/site first. The repository's root is linked as the `hybridspec`
# package (it is one: cloud/, edge/, common/ ... sit at the root). Writes OUT/results.{json,md,png} and
# OUT/log.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu_run.sh OUT [flags]}
shift
mkdir -p "$out" /tmp/pkg
if compgen -G ".whl/*.whl" >/dev/null; then
  "${PYTHON:-python3}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
ln -sfn "$PWD" /tmp/pkg/hybridspec
export PYTHONPATH="/tmp/pkg:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export HYBRIDSPEC_COMMIT="${HYBRIDSPEC_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$out/log.txt" || true
"${PYTHON:-python3}" bench/gpu_suite.py --preset issue53 --out "$out" "$@" 2>&1 | tee -a "$out/log.txt"
