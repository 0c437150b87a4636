"""The layers point one way (docs/architecture.md, "Layers"): common imports neither edge nor cloud; edge
imports no cloud; in cloud, the top-level modules (config.py, process.py) may import every layer,
then api -> pool -> core -> engine, each importing only those below it; none of them imports the
programs built on them (cli, lab, ...); and no two packages import each other, directly or through
others. Every import counts: at module level, inside functions and under TYPE_CHECKING alike."""
import ast
from dataclasses import dataclass
from pathlib import Path

from test_layout import cycles  # Tarjan's strongly connected components, written once

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ("common", "edge", "cloud")  # folders mapped to hybridspec.<name> (pyproject.toml package-dir)
PROGRAMS = ("cli", "distill", "netem", "lab", "fetch")  # built on the layers; never imported by them
GENERATED = ROOT / "common" / "protocol" / "proto"
# Each layer and the layers it may import, its own included.
CLOUD_ORDER = ("cloud", "cloud.api", "cloud.pool", "cloud.core", "cloud.engine")  # top to bottom
ALLOWED = {"common": {"common"}, "edge": {"common", "edge"}}
ALLOWED |= {layer: {"common", *CLOUD_ORDER[i:]} for i, layer in enumerate(CLOUD_ORDER)}


@dataclass(frozen=True)
class Import:
    """One import statement's reach into the project: who, where, what."""

    source: str  # importing module, e.g. hybridspec.cloud.pool.replica
    target: str  # imported module or package, e.g. hybridspec.cloud.api.server
    where: str  # file:line, relative to the repository root


def modules(root: Path = ROOT) -> dict[str, Path]:
    """hybridspec module name -> file, for every .py under the checked folders (generated code excluded)."""
    found = {}
    for folder in CHECKED:
        for path in (root / folder).rglob("*.py"):
            if root / GENERATED.relative_to(ROOT) in path.parents:
                continue
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(("hybridspec", *(parts[:-1] if parts[-1] == "__init__" else parts)))] = path
    return found


def package_of(module: str, path: Path) -> str:
    """The package a module belongs to: itself for an __init__.py, else its parent."""
    return module if path.name == "__init__.py" else module.rsplit(".", 1)[0]


def imports(module: str, path: Path, known: set[str], root: Path = ROOT) -> list[Import]:
    """Every hybridspec module or package `module` imports, relative imports resolved."""
    package = package_of(module, path)
    where = lambda node: f"{path.relative_to(root)}:{node.lineno}"  # noqa: E731
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [Import(module, alias.name, where(node)) for alias in node.names if alias.name.startswith("hybridspec")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if not base.startswith("hybridspec"):
                continue
            for alias in node.names:  # `from pkg import module` imports the module; else the names are in `base`
                out.append(Import(module, f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base,
                                  where(node)))
    return list(dict.fromkeys(out))  # `from m import a, b` is one import of m


def layer(module: str) -> str:
    """hybridspec.cloud.pool.replica -> cloud.pool; hybridspec.cloud.config -> cloud; hybridspec.edge.serve.app -> edge."""
    parts = module.split(".")[1:]
    if parts[0] == "cloud" and len(parts) > 1 and f"cloud.{parts[1]}" in CLOUD_ORDER:
        return f"cloud.{parts[1]}"
    return parts[0]


def every_import(root: Path = ROOT) -> list[Import]:
    """Every project import made by the checked folders' modules."""
    known = modules(root)
    return [imp for name, path in known.items() for imp in imports(name, path, set(known), root)]


def upward(found: list[Import]) -> list[str]:
    """One line per import of a layer that its importer's layer may not import."""
    bad = []
    for imp in found:
        source, target = layer(imp.source), layer(imp.target)
        if target in PROGRAMS or target not in ALLOWED[source]:
            bad.append(f"{imp.where}: {imp.source} ({source}) imports {imp.target} ({target})")
    return bad


def package_cycles(found: list[Import], root: Path = ROOT) -> list[str]:
    """One line per group of packages that import each other, with a file:line for each import inside it."""
    known = modules(root)
    package = {name: package_of(name, path) for name, path in known.items()}
    edges: dict[tuple[str, str], str] = {}
    for imp in found:
        a, b = package[imp.source], package.get(imp.target, imp.target.rsplit(".", 1)[0])
        if a != b:
            edges.setdefault((a, b), imp.where)
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    lines = []
    for group in cycles(graph):
        inside = sorted(f"{a} -> {b} ({where})" for (a, b), where in edges.items() if a in group and b in group)
        lines.append(f"package cycle {' <-> '.join(group)}: " + "; ".join(inside))
    return lines


def test_the_checker_finds_deferred_relative_and_cyclic_imports(tmp_path):
    """On a small tree made to break the rules, each broken rule is named by file:line (the checker can fail)."""
    files = {
        "common/__init__.py": "",
        "common/util.py": "import hybridspec.edge.worker\n",
        "edge/__init__.py": "",
        "edge/worker.py": "from ..cloud.config import ServeConfig\nfrom ..common import util\n",
        "cloud/__init__.py": "",
        "cloud/config.py": "from .api import server\nfrom .engine.kinds import Kind\n",
        "cloud/api/__init__.py": "",
        "cloud/api/server.py": "from ..core.verifier import Verifier\n",
        "cloud/core/__init__.py": "",
        "cloud/core/verifier.py": "import json\n\n\ndef f():\n    from ..api.server import X\n",
        "cloud/engine/__init__.py": "",
        "cloud/engine/kinds.py": "from ...cli import main\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = every_import(tmp_path)
    assert sorted(upward(found)) == [
        "cloud/core/verifier.py:5: hybridspec.cloud.core.verifier (cloud.core) imports hybridspec.cloud.api.server "
        "(cloud.api)",
        "cloud/engine/kinds.py:1: hybridspec.cloud.engine.kinds (cloud.engine) imports hybridspec.cli (cli)",
        "common/util.py:1: hybridspec.common.util (common) imports hybridspec.edge.worker (edge)",
        "edge/worker.py:1: hybridspec.edge.worker (edge) imports hybridspec.cloud.config (cloud)"]
    assert package_cycles(found, tmp_path) == [
        "package cycle hybridspec.cloud.api <-> hybridspec.cloud.core: "
        "hybridspec.cloud.api -> hybridspec.cloud.core (cloud/api/server.py:1); "
        "hybridspec.cloud.core -> hybridspec.cloud.api (cloud/core/verifier.py:5)",
        "package cycle hybridspec.common <-> hybridspec.edge: hybridspec.common -> hybridspec.edge (common/util.py:1); "
        "hybridspec.edge -> hybridspec.common (edge/worker.py:2)"]


def test_no_layer_imports_one_above_it():
    bad = upward(every_import())
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_no_two_packages_import_each_other():
    bad = package_cycles(every_import())
    assert not bad, "\n".join(bad)
