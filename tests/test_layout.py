"""The shape of the code: no two modules that import each other, directly or through others, even with
the import deferred into a function. (A module's length is not capped: a module is one job, and a job
that reads top-down in one place is better than five short modules that forward to each other.)"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "cloud", "edge", "cli", "distill", "netem", "lab", "fetch")  # each is hybridspec.<name>
GENERATED = ROOT / "common" / "protocol" / "proto"


def modules() -> dict[str, Path]:
    """hybridspec module name -> its file, generated protobuf code excluded."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if GENERATED in path.parents:
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(("hybridspec", *parts))] = path
    return found


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The hybridspec modules `name` imports anywhere in its file (top level or inside functions)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}  # `from pkg import module`
    return {m for m in found if m in known and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_even_deferred_ones():
    found = modules()
    # A package's __init__ is imported before its modules anyway; an edge to it is no cycle of ours.
    graph = {name: {m for m in imports_of(name, path, set(found)) if found[m].name != "__init__.py"}
             for name, path in found.items()}
    assert cycles(graph) == []


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": set()}, []),
])
def test_the_cycle_finder_finds_cycles(graph, expected):
    assert cycles(graph) == expected


@pytest.mark.parametrize("module", ["hybridspec.cloud.config", "hybridspec.edge.config", "hybridspec.edge.serve.config",
                                    "hybridspec.distill.config", "hybridspec.netem.config", "hybridspec.cli.main"])
def test_configuration_imports_nothing_heavy(module):
    """Settings are read and checked (one line for a bad value) before torch, Ray, transformers or gRPC
    load: the CLI, its every flag made from the configs, answers --help and refuses a bad flag in well
    under a second."""
    import subprocess
    import sys

    probe = (f"import sys, {module}; import hybridspec.cli.main as m; m.build_parser(); "
             "print(' '.join(m for m in ('torch', 'ray', 'transformers', 'grpc') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert loaded == [], f"importing {module} loads {loaded}"
