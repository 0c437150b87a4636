"""A pulled target keeps its GGUF and writes the torch checkpoint only when torch first needs it."""
import os
import shutil
import subprocess
import sys

import pytest
import torch

from hybridspec.common.models.checkpoint import CHECKPOINT_FILES, SHARED_TENSORS, deferred, write_deferred
from hybridspec.common.models.gguf import GGUF_FILE, typed_gguf
from hybridspec.common.models.loading import load_model

from conftest import require_embedded

pytestmark = [pytest.mark.embedded, pytest.mark.slow]  # slow: every test reads the embedded GGUF and writes checkpoints


@pytest.fixture(scope="module")
def deferred_home(tmp_path_factory):
    """A models home whose target is written as `models pull` writes it now (from the real embedded
    GGUF), beside the real drafters."""
    require_embedded()
    from hybridspec.common.models.embedded import default_paths

    real = default_paths()
    home = tmp_path_factory.mktemp("home")
    target = home / "models" / real["target"].name
    target.mkdir(parents=True)
    # The shipped Q4_1 file, whatever type the real home serves (a pull writes Q8_0 beside it).
    from hybridspec.fetch.embedded import SHIPPED_WEIGHTS

    shipped = typed_gguf(real["target"], SHIPPED_WEIGHTS).resolve()
    write_deferred(shipped, target, shipped.name)
    shutil.copyfile(shipped, target / shipped.name)
    (target / GGUF_FILE).symlink_to(shipped.name)
    for role in ("plain", "eagle"):
        (home / "models" / real[role].name).symlink_to(real[role])
    return home, real


def test_a_pull_keeps_no_torch_checkpoint(deferred_home):
    home, real = deferred_home
    target = home / "models" / real["target"].name
    assert deferred(target) == target / (target / GGUF_FILE).resolve().name
    assert not any((target / f).exists() for f in CHECKPOINT_FILES)
    size = sum(f.stat().st_size for f in target.iterdir() if f.is_file() and not f.is_symlink())
    assert size < 260e6, f"{size / 1e6:.0f} MB"  # GGUF 98 MB + shared tensors 113 MB; the checkpoint alone is 538 MB


def test_a_drafter_loads_from_the_shared_tensors_without_the_checkpoint(deferred_home, monkeypatch):
    home, real = deferred_home
    monkeypatch.setenv("HYBRIDSPEC_HOME", str(home))
    ours = load_model(home / "models" / real["plain"].name, device="cpu", engine="torch")
    theirs = load_model(real["plain"], device="cpu", engine="torch")
    assert deferred(home / "models" / real["target"].name) is not None  # still not written
    ids = torch.tensor([[1, 504, 3290, 314, 260]])
    assert torch.equal(ours.model(ids).logits, theirs.model(ids).logits)


def test_the_torch_engine_writes_the_checkpoint_once_and_it_equals_the_old_one(deferred_home):
    home, real = deferred_home
    target = home / "models" / real["target"].name
    # Two processes loading at once (as two Ray replicas starting together do): one writes, one waits.
    load = ("import sys; from hybridspec.common.models.loading import load_model; "
            "load_model(sys.argv[1], device='cpu')")
    env = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1"}  # as the CLI runs
    procs = [subprocess.Popen([sys.executable, "-c", load, str(target)], stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    logs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    assert sum("writing the torch checkpoint" in log for log in logs) == 1
    # The size it takes is said first, then the de-quantisation shows its progress (the CLI hides bars).
    writer = next(log for log in logs if "writing the torch checkpoint" in log)
    said = writer.index("writing the torch checkpoint")
    assert "538 MB on disk" in writer[said:said + 200] and writer.index("de-quantizing", said) > said
    assert deferred(target) is None and not (target / ".checkpoint.partial").exists()
    ours, reference = load_model(target, device="cpu"), load_model(real["target"], device="cpu")
    ids = torch.tensor([[1, 504, 3290, 314, 260]])
    assert torch.equal(ours.model(ids).logits, reference.model(ids).logits)
    assert os.path.getsize(target / "model.safetensors") > 500e6
    assert (target / SHARED_TENSORS).is_file()
