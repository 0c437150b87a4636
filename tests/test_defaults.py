"""One source for each default: a setting's default is written where the setting is defined (`setting`)
and copied everywhere else (`like`, a named constant, the owning dataclass's attribute), never typed
again as a literal. A literal default of a function parameter or a dataclass field in common/, edge/ or
cloud/ that equals a config setting's default, under a name that shares a word with the setting's, is
a second copy that can drift: this test names it by file:line."""
import ast
import dataclasses
from pathlib import Path

from hybridspec.cloud.config import ServeConfig
from hybridspec.edge.config import EdgeConfig
from hybridspec.edge.serve.config import ServeOptions

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("common", "edge", "cloud")
TRIVIAL = (0, 1, -1)  # off, on, none: too common to be copies of a setting


def setting_defaults() -> dict[str, object]:
    """Setting name -> default, for every config's number settings whose default says something."""
    found = {}
    for config in (EdgeConfig, ServeConfig, ServeOptions):
        for f in dataclasses.fields(config):
            value = f.default
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value not in TRIVIAL:
                found[f.name] = value
    return found


def literal_defaults(tree: ast.AST):
    """(name, value, line) of every parameter default and class-level field default that is a literal number."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            positional = [*args.posonlyargs, *args.args]
            pairs = [*zip(positional[len(positional) - len(args.defaults):], args.defaults),
                     *zip(args.kwonlyargs, args.kw_defaults)]
            for arg, default in pairs:
                if isinstance(default, ast.Constant):
                    yield arg.arg, default.value, default.lineno
        elif isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                        and isinstance(stmt.value, ast.Constant)):
                    yield stmt.target.id, stmt.value.value, stmt.lineno


def share_a_word(a: str, b: str) -> bool:
    """max_ngram and ngram_max do; timeout_s and reconnect_s do not (units are not words here)."""
    words = lambda name: set(name.split("_")) - {"s", "ms", "max", "min", "tokens"}  # noqa: E731
    return bool(words(a) & words(b))


def repeated_defaults(folders=FOLDERS, root: Path = ROOT) -> list[str]:
    """One line per literal that repeats a setting's default."""
    settings = setting_defaults()
    bad = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            for name, value, line in sorted(literal_defaults(ast.parse(path.read_text())), key=lambda d: d[2]):
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                same = sorted(s for s, default in settings.items() if value == default and share_a_word(name, s))
                if same:
                    bad.append(f"{path.relative_to(root)}:{line}: {name} = {value!r} repeats the default of "
                               + ", ".join(same))
    return bad


def test_the_checker_finds_a_copied_default(tmp_path):
    (tmp_path / "edge").mkdir()
    (tmp_path / "edge" / "client.py").write_text(
        "class Client:\n    def __init__(self, address, timeout_s: float = 30.0, retries=3):\n        pass\n\n\n"
        "class Settings:\n    wire_top_k: int = 64\n    seed: int = 64\n")
    assert repeated_defaults(("edge",), tmp_path) == [
        "edge/client.py:2: timeout_s = 30.0 repeats the default of ray_join_timeout_s, timeout_s",
        "edge/client.py:7: wire_top_k = 64 repeats the default of wire_top_k"]


def test_no_setting_default_is_typed_twice():
    bad = repeated_defaults()
    assert not bad, "defaults written twice (define them once, reference them elsewhere):\n" + "\n".join(bad)
