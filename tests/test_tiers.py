"""The two tiers of the suite (README's Tests, docs/measurements.md): `make test`, what CI runs, is every
test; `make test-fast`, before every commit, leaves out the tests marked `slow`. A mark can only take a
test out of the fast tier, never out of the full one, and the fast tier still reaches every package:
each is imported by a test module that has tests outside the mark."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
# Packages of generated code and data, which tests reach through the packages that use them.
NOT_TESTED_DIRECTLY = ("hybridspec.common.protocol.proto", "hybridspec.fetch.assets")
# Packages whose only tests are slow, and why.
FULL_TIER_ONLY = {"hybridspec.lab.gpu_suite": "a GPU benchmark: its test is the CPU dry run of bench/gpu_suite.py (40 s)"}


def packages() -> list[str]:
    """The packages the wheel ships (pyproject.toml), but generated code and data."""
    listed = re.search(r"^packages = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    return [p for p in re.findall(r'"([\w.-]+)"', listed) if not p.startswith(NOT_TESTED_DIRECTLY)]


def is_slow(node: ast.expr) -> bool:
    """`pytest.mark.slow`, alone or in a list of marks."""
    if isinstance(node, (ast.List, ast.Tuple)):
        return any(is_slow(n) for n in node.elts)
    return ast.unparse(node) == "pytest.mark.slow"


def fast_tests(tree: ast.Module) -> list[str]:
    """The module's test functions that the fast tier runs."""
    if any(isinstance(n, ast.Assign) and any(ast.unparse(t) == "pytestmark" for t in n.targets) and is_slow(n.value)
           for n in tree.body):
        return []
    return [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.name.startswith("test_") and not any(is_slow(d) for d in n.decorator_list)]


def imported(tree: ast.Module) -> set[str]:
    """Every hybridspec module the test module imports, at module level or inside its functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hybridspec"):
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("hybridspec")}
    return found


def package_of(module: str, known: list[str]) -> str | None:
    """The shipped package a module belongs to: the longest of `known` it is in (or is)."""
    within = [p for p in known if module == p or module.startswith(p + ".")]
    return max(within, key=len) if within else None


def test_every_package_has_tests_in_the_fast_tier():
    known, reached = packages(), set()
    for path in TESTS.glob("test_*.py"):
        tree = ast.parse(path.read_text())
        if fast_tests(tree):
            reached |= {package_of(m, known) for m in imported(tree)}
    assert len(known) > 10 and set(known) - reached == set(FULL_TIER_ONLY), sorted(set(known) - reached)


def test_the_scan_sees_marks_and_imports():
    module = ast.parse("import pytest\nfrom hybridspec.netem import relay\n\n@pytest.mark.slow\ndef test_a(): pass\n\n"
                       "def test_b():\n    from hybridspec.lab.stats import mean_ci\n")
    assert fast_tests(module) == ["test_b"] and "hybridspec.lab.stats" in imported(module)
    slow_module = "import pytest\npytestmark = [pytest.mark.embedded, pytest.mark.slow]\ndef test_a(): pass\n"
    assert fast_tests(ast.parse(slow_module)) == []
    assert package_of("hybridspec.cloud.config", packages()) == "hybridspec.cloud"
    assert package_of("hybridspec.cloud.api.access", packages()) == "hybridspec.cloud.api"


def test_the_full_tier_is_every_test():
    """`make test` selects nothing away (no -m, no -k, nothing in addopts); `make test-fast` only `slow`."""
    make = (ROOT / "Makefile").read_text()
    full = re.search(r"^test: .*\n\t(.*)$", make, re.M).group(1)
    fast = re.search(r"^test-fast: .*\n\t(.*)$", make, re.M).group(1)
    assert full == "$(BIN)/python -m pytest"
    assert fast == '$(BIN)/python -m pytest -m "not slow"'
    addopts = re.search(r'^addopts = "(.*)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert not re.search(r"(^|\s)(-m|-k|--deselect|--ignore)", addopts), addopts
    assert "--strict-markers" in addopts  # a misspelt mark is an error, not a test silently in the fast tier
    assert "bash" in (ROOT / ".ci" / "run").read_text() and "make test\n" in (ROOT / ".ci" / "run").read_text()
