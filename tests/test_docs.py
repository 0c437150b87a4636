"""The docs a newcomer reads stay true: every relative link and #anchor in README.md, bench/README.md and
docs/ resolves, every figure registered in docs/figures.yaml still reads what its result file says, and
every file cited from git history (COMMIT:PATH) is in that commit."""
from __future__ import annotations

import csv
import io
import json
import re
import statistics
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.MULTILINE)
CODE = re.compile(r"```.*?```", re.DOTALL)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text (code marks and link targets dropped) in lower case,
    punctuation but hyphens and underscores dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").replace("*", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, title in HEADING.findall(CODE.sub("", page.read_text())):
        base = slug(title)
        n = seen.get(base, 0)
        out.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return out


def links(page: Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(CODE.sub("", page.read_text()))
            if not re.match(r"[a-z]+:", m.group(1))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading makes #{anchor}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


# A file no longer in the tree, named with the commit that has it: `92253c5:bench/coupling.py`.
CITED = re.compile(r"(?<![\w/])([0-9a-f]{7,40}):((?:bench|docs|experiments|scripts)/[a-z0-9_./-]*[a-z0-9_])")


def test_every_file_cited_from_git_history_is_in_that_commit():
    """Docs and comments may name a removed benchmark or result file as COMMIT:PATH; git must have it
    there (skipped in a copy without the repository's history)."""
    if subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", "HEAD"], capture_output=True).returncode:
        pytest.skip("no git history here")
    texts = [*PAGES, ROOT / "docs" / "figures.yaml", *ROOT.glob("bench/*"),
             *(f for top in ("cli", "cloud", "common", "edge", "lab", "tests") for f in (ROOT / top).rglob("*.py"))]
    cited = {m.groups() for f in texts if f.is_file() for m in CITED.finditer(f.read_text())}
    assert cited, "no COMMIT:PATH citation found: the pattern no longer matches the docs"
    missing = sorted(f"{commit}:{path}" for commit, path in cited
                     if subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}:{path}"],
                                       capture_output=True).returncode)
    assert not missing, f"not in git history at the commit named: {missing}"


def test_the_slug_rules_match_githubs():
    assert slug("Exactness by construction") == "exactness-by-construction"
    assert slug("Results: the RTT sweep on this machine") == "results-the-rtt-sweep-on-this-machine"
    assert slug("`cloud serve` (local config)") == "cloud-serve-local-config"
    assert slug("Choosing γ (`gamma_policy: adaptive`, `edge/policy.py`)") == \
        "choosing-γ-gamma_policy-adaptive-edgepolicypy"


FIGURES = yaml.safe_load((ROOT / "docs" / "figures.yaml").read_text())
SELECT = re.compile(r"^(?P<key>[^\[\]]+)?(?:\[(?P<sel>[^\]]+)\])?$")
FIRST_SCREEN_UNITS = re.compile(r"\d[\d.,]*\s*(?:ms|×|tokens/s|tok/s|%|s\b|min\b)")


def load(file: Path):
    """A result file: JSON, JSON lines (a list of rows) or CSV (a list of rows, values as text)."""
    text = file.read_text()
    if file.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    if file.suffix == ".csv":
        return list(csv.DictReader(io.StringIO(text)))
    return json.loads(text)


def lookup(data, path: str, every: bool = False):
    """A value in a result file: keys joined by slashes, `[i]` an index, `[k=v,…]` the first list item
    whose fields equal those values (with `every`, all of them: a list of the rest of the path's values)."""
    parts = re.split(r"/(?![^\[]*\])", path)
    for i, part in enumerate(parts):
        m = SELECT.match(part)
        if m.group("key"):
            data = data[m.group("key")]
        sel = m.group("sel")
        if sel is None:
            continue
        if sel.lstrip("-").isdigit():
            data = data[int(sel)]
            continue
        want = dict(item.split("=", 1) for item in sel.split(","))
        rows = [row for row in data if all(str(row[k]) == v for k, v in want.items())]
        if every:
            rest = "/".join(parts[i + 1:])
            return [lookup(row, rest) if rest else row for row in rows]
        data = rows[0]
    return data


def figure(entry: dict) -> str:
    """The quote a registry entry's result file gives today (`reduce: mean` or `median` over every
    row its selector matches; `scale` multiplies, for units: 1000 quotes seconds in ms)."""
    data = load(ROOT / entry["file"])
    reduce = {"mean": statistics.mean, "median": statistics.median}.get(entry.get("reduce"))

    def value_at(path: str):
        if reduce is None:
            value = lookup(data, path)
            return float(value) if isinstance(value, str) else value
        return reduce([float(v) for v in lookup(data, path, every=True)])

    value = value_at(entry["value"])
    if "over" in entry:
        value = value / value_at(entry["over"])
    return entry["format"].format(value * entry.get("scale", 1))


@pytest.mark.parametrize("entry", FIGURES, ids=lambda e: f"{e['page']}: {e['quote']}")
def test_every_registered_figure_is_on_its_page_and_still_what_its_result_file_says(entry):
    assert entry["quote"] in (ROOT / entry["page"]).read_text(), f"{entry['quote']!r} is no longer on {entry['page']}"
    assert figure(entry) == entry["quote"], f"{entry['file']} now gives {figure(entry)!r}"


def test_the_readmes_first_screen_quotes_only_registered_figures():
    """Measured numbers above README's first second-level heading each have a registry entry."""
    first = (ROOT / "README.md").read_text().split("\n## ", 1)[0]
    registered = {e["quote"] for e in FIGURES if e["page"] == "README.md"}
    unregistered = [m.group(0) for m in FIRST_SCREEN_UNITS.finditer(CODE.sub("", first))
                    if not any(m.group(0) in quote or quote in m.group(0) for quote in registered)]
    assert not unregistered, f"README's first screen quotes figures with no source in docs/figures.yaml: {unregistered}"


def test_the_python_the_docs_require_is_the_one_pyproject_requires():
    """README (and any page naming a requirement) asks for the Python version pip will enforce."""
    required = re.search(r'requires-python\s*=\s*">=\s*([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    stated = {(page.relative_to(ROOT), m.group(1)) for page in PAGES
              for m in re.finditer(r"Python\s*(?:≥|>=)\s*([\d.]+)", page.read_text())}
    assert stated, "README no longer states which Python it needs"
    wrong = [f"{page}: Python ≥ {version}" for page, version in stated if version != required]
    assert not wrong, f"pyproject requires Python >={required}, but {wrong}"


def test_the_readmes_layout_table_names_every_folder_in_the_tree():
    """Each tracked top-level folder, and each package folder inside cloud/, common/ and edge/, has
    its row in README's layout table (a new folder cannot go undocumented)."""
    table = (ROOT / "README.md").read_text().split("\n## Layout", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"^\| `([^`]+)`", table, re.MULTILINE))
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    folders = {f.split("/")[0] + "/" for f in tracked if "/" in f}
    folders |= {f"{top}/{p.name}/" for top in ("cloud", "common", "edge")
                for p in (ROOT / top).iterdir() if (p / "__init__.py").is_file()}
    missing = [f for f in sorted(folders) if not any(n.startswith(f) for n in named)]
    assert not missing, f"README's layout table has no row for {missing}"


def test_a_registry_path_reads_json_lines_and_csv_and_reduces_over_every_matching_row(tmp_path, monkeypatch):
    rows = [{"s": "a", "x": 1.0}, {"s": "b", "x": 5.0}, {"s": "a", "x": 3.0}]
    (tmp_path / "r.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "r.csv").write_text("s,x\n" + "".join(f"{r['s']},{r['x']}\n" for r in rows))
    for name in ("r.jsonl", "r.csv"):
        data = load(tmp_path / name)
        assert float(lookup(data, "[s=a]/x")) == 1.0
        assert [float(v) for v in lookup(data, "[s=a]/x", every=True)] == [1.0, 3.0]
    monkeypatch.setitem(figure.__globals__, "ROOT", tmp_path)
    assert figure({"file": "r.csv", "reduce": "mean", "value": "[s=a]/x", "over": "[s=b]/x",
                   "format": "{:.2f}"}) == "0.40"
