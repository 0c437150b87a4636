"""docs/models.md, followed as a user would: the embedded target's GGUF and the embedded drafter
exported as a GGUF, each alone in a directory with no tokenizer files; `pair check`, `cloud serve`
and `edge generate` (default, --cloud-only, forced hybrid) on them, through the console script. The
commands run are the page's, with test-sized flags added; the error line the page quotes is the one
a drafter of another vocabulary gets."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import require_embedded

pytestmark = pytest.mark.embedded
PAGE = Path(__file__).resolve().parents[1] / "docs" / "models.md"


def hybridspec(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridspec.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """Step 1 and 5 of the page: a target GGUF alone in a directory, and a drafter GGUF written by
    `models export-drafter`, alone in another."""
    require_embedded()
    from hybridspec.common.models.embedded import default_paths

    root = tmp_path_factory.mktemp("own")
    (root / "target").mkdir()
    (root / "drafter").mkdir()
    target = root / "target" / "T.gguf"
    os.link(default_paths()["target"] / "model.Q8_0.gguf", target)
    run = hybridspec("models", "export-drafter", "embedded:plain", str(root / "drafter" / "D.gguf"))
    assert run.returncode == 0, run.stderr
    drafter = Path(run.stdout.strip())
    assert sorted(p.name for p in target.parent.iterdir()) == ["T.gguf"]
    assert sorted(p.name for p in drafter.parent.iterdir()) == ["D.gguf"]
    return {"target": target, "drafter": drafter, "root": root}


def test_the_page_shows_these_commands():
    page = PAGE.read_text()
    for command in ("hybridspec pair check --target T.gguf --drafter D.gguf",
                    "hybridspec cloud serve --target T.gguf --backend inprocess",
                    "hybridspec edge generate --cloud HOST:PORT --drafter D.gguf",
                    "hybridspec models export-drafter DRAFTER_DIR D.gguf",
                    "hybridspec models export-drafter embedded:plain D.gguf"):
        assert command in page, command


def test_pair_check(files):
    prompts = files["root"] / "prompts.txt"
    prompts.write_text("Write a Python function that adds two numbers.\nWhat is the capital of France?\n")
    run = hybridspec("pair", "check", "--target", str(files["target"]), "--drafter", str(files["drafter"]),
                     "--prompts", str(prompts), "--new-tokens", "8", "--json")
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout)
    assert report["pair"]["vocab_size"] == 49152 and report["pair"]["same_chat_template"]
    assert report["engine"] == "llamacpp" and len(report["target_pass_ms"]) == 9 and len(report["drafter_ms"]) == 9
    assert report["prompts"] == 2 and len(report["acceptance"]["by_position"]) == 8
    assert report["here"]["choice"] in ("hybrid", "cloud-only") and 1 <= report["here"]["gamma"] <= 8
    assert report["gpu"]["where"].startswith("NVIDIA") and "smollm2-135m" in report["gpu"]["where"]
    readable = hybridspec("pair", "check", "--target", str(files["target"]), "--drafter", str(files["drafter"]),
                          "--prompts", str(prompts), "--new-tokens", "4")
    assert readable.returncode == 0 and "identical: 49152 tokens" in readable.stdout, readable.stderr[-2000:]


def test_the_error_line_the_page_quotes(files):
    from tinymodels import save_gguf

    (files["root"] / "other").mkdir()
    other = save_gguf(files["root"] / "other" / "other.gguf")
    run = hybridspec("pair", "check", "--target", str(files["target"]), "--drafter", str(other))
    assert run.returncode == 2
    (line,) = run.stderr.strip().splitlines()
    assert line in PAGE.read_text(), line


def test_serve_and_draft(files):
    from hybridspec.cloud.process import parse_ready_line

    cloud = subprocess.Popen([sys.executable, "-m", "hybridspec.cli.main", "cloud", "serve", "--target",
                              str(files["target"]), "--backend", "inprocess", "--port", "0", "--metrics-port", "-1"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        address = next(a for a in map(parse_ready_line, cloud.stdout) if a)
        runs = {}
        for mode, flags in (("default", ()), ("cloud-only", ("--cloud-only",)),
                            ("hybrid", ("--no-cloud-only-switch",))):
            run = hybridspec("edge", "generate", "--cloud", address, "--drafter", str(files["drafter"]), "--prompt",
                             "Write a Python function that adds two numbers.", "--chat", "--max-new-tokens", "16",
                             "--json", *flags)
            assert run.returncode == 0, run.stderr[-2000:]
            runs[mode] = json.loads(run.stdout)
        assert runs["default"]["token_ids"] == runs["cloud-only"]["token_ids"] == runs["hybrid"]["token_ids"]
        assert len(runs["cloud-only"]["token_ids"]) == 16 == runs["cloud-only"]["stats"]["cloud_only_tokens"]
        assert runs["hybrid"]["stats"]["rounds"] > 0
    finally:
        cloud.terminate()
        cloud.wait(timeout=60)
