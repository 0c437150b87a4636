"""docs/cli.md, the command-line reference, is what the argparse parsers' --help prints now: a flag
added, renamed or re-described without regenerating the page fails here."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_cli_reference_is_what_help_prints():
    result = subprocess.run([sys.executable, "scripts/gen_cli_docs.py", "--check"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_check_fails_on_a_stale_page(tmp_path, monkeypatch):
    """The check can fail: a page missing one flag's line is stale."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_cli_docs", ROOT / "scripts" / "gen_cli_docs.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    monkeypatch.setenv("COLUMNS", gen.WIDTH)
    page = gen.render()
    assert "--prefix-scope" in page and "## hybridspec cloud serve" in page
    monkeypatch.setattr(gen, "PAGE", tmp_path / "cli.md")
    gen.PAGE.write_text(page.replace("--prefix-scope", "--prefix-scop", 1))
    monkeypatch.setattr(sys, "argv", ["gen_cli_docs.py", "--check"])
    assert gen.main() == 1
    gen.PAGE.write_text(page)
    assert gen.main() == 0
