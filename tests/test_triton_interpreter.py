"""Runs tests/test_triton_kernels.py (the CUDA kernels on the CPU) in a process that asks Triton's
interpreter for them from its start: Triton reads TRITON_INTERPRET when it is first imported, and in
this process torch has already imported it. Skipped where Triton is not installed."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="Triton is not installed (CPU machines and CI run the torch kernels)")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="this process interprets: pytest runs them")
def test_the_cuda_kernels_under_triton_s_interpreter():
    tests = Path(__file__).resolve().parent
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_triton_kernels.py"],
                         env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=tests, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout
