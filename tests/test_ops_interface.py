"""Both kernel backends take what llama.forward passes them (cloud/engine/llama.py's `Ops`).

The CUDA backend needs Triton, which a CPU machine lacks, so its methods are read from the source:
a keyword added to `Ops` and to the CPU backend alone once broke every GPU pass (TritonOps.linear()
got an unexpected keyword argument 'parts'), and only a GPU run could see it.
"""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

from hybridspec.cloud.engine import llama, torch_ops

TRITON_OPS = Path(llama.__file__).with_name("triton_ops.py")


def _protocol_methods() -> dict[str, list[str]]:
    return {name: list(inspect.signature(fn).parameters)
            for name, fn in vars(llama.Ops).items() if inspect.isfunction(fn) and not name.startswith("_")}


def _source_methods(path: Path, cls: str) -> dict[str, list[str]]:
    tree = ast.parse(path.read_text())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    return {f.name: [a.arg for a in f.args.args + f.args.kwonlyargs]
            for f in body if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")}


def _accepts(params: list[str], wanted: list[str]) -> bool:
    """The backend's parameters start with the protocol's, in order (extra ones after are its own)."""
    return params[:len(wanted)] == wanted


def test_the_cuda_backend_takes_every_argument_the_forward_passes() -> None:
    backend = _source_methods(TRITON_OPS, "TritonOps")
    for name, wanted in _protocol_methods().items():
        assert name in backend, f"TritonOps lacks {name}"
        assert _accepts(backend[name], wanted), f"TritonOps.{name}{tuple(backend[name])} vs Ops {tuple(wanted)}"


def test_the_cpu_backend_takes_every_argument_the_forward_passes() -> None:
    for name, wanted in _protocol_methods().items():
        params = list(inspect.signature(getattr(torch_ops.TorchOps, name)).parameters)
        assert _accepts(params, wanted), f"TorchOps.{name}{tuple(params)} vs Ops {tuple(wanted)}"
