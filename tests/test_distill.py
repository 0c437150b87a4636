"""Distillation on the tiny target: the loss falls and the drafter works through the edge path."""
import json
import statistics

import pytest

from safetensors import safe_open

from hybridspec.common.models.compact import MANIFEST, WEIGHTS
from hybridspec.common.models.loading import load_model
from hybridspec.distill.config import DistillConfig
from hybridspec.distill.train import distill
from hybridspec.edge.client import VerifierClient
from hybridspec.edge.config import EdgeConfig
from hybridspec.edge.worker import EdgeWorker

from tinymodels import EVERY_ROUND, greedy_reference


@pytest.fixture(scope="module")
def distilled(model_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("distilled")
    report = distill(DistillConfig(target=str(model_dirs["target"]), out=str(out), layers=1, steps=40, generate=32,
                                   max_new_tokens=24, heldout=4, eval_every=20, head_size=128,
                                   batch_tokens=256, seed=0))
    return out, report


def test_loss_falls_and_agreement_rises(distilled):
    out, report = distilled
    losses = report["losses"]
    assert len(losses) == 40
    assert statistics.mean(losses[-10:]) < statistics.mean(losses[:5])
    assert report["curve"][-1]["agreement"] > report["curve"][0]["agreement"]
    assert json.loads((out / "report.json").read_text())["final"]["agreement"] == report["final"]["agreement"]


def test_compact_checkpoint_stores_only_its_own_weights(distilled, target):
    out, _ = distilled
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["num_layers"] == 1
    with safe_open(out / WEIGHTS, framework="pt") as f:
        stored = set(f.keys())
    assert stored and not any("embed_tokens" in k or "lm_head" in k for k in stored)
    assert all(k.startswith(("model.layers.0.", "model.norm.")) or k == "head_ids" for k in stored)


def test_distilled_drafter_drafts_through_the_edge_path(distilled, server, target):
    out, _ = distilled
    drafter = load_model(out, device="cpu")
    assert drafter.head_ids is not None and drafter.head_ids.numel() == 128
    config = EdgeConfig.of(cloud=server.address, max_new_tokens=20, max_draft=4, fallback_threshold=0.0,
                           **EVERY_ROUND)
    prompt = [5, 17, 33, 80]
    with VerifierClient(server.address) as client:
        gen = EdgeWorker(drafter, client, config).generate(prompt)
    assert gen.token_ids == greedy_reference(target, prompt, 20)
    assert gen.stats.accepted > 0


def test_int8_storage_halves_the_weights_and_keeps_the_predictions(model_dirs, target, tmp_path):
    import torch

    from hybridspec.common.models.compact import Manifest
    from hybridspec.distill.student import build_student, own_state, save_compact

    student = build_student(target.model, 2, torch.arange(200))
    manifest = Manifest(base=str(model_dirs["target"]), num_layers=2, base_tokenizer_fingerprint="")
    save_compact(own_state(student), torch.arange(200), tmp_path / "fp16", manifest)
    save_compact(own_state(student), torch.arange(200), tmp_path / "int8", Manifest(**{**manifest.__dict__, "store": "int8"}))
    fp16, int8 = (load_model(tmp_path / d, device="cpu") for d in ("fp16", "int8"))
    assert (tmp_path / "int8" / WEIGHTS).stat().st_size < 0.6 * (tmp_path / "fp16" / WEIGHTS).stat().st_size
    ids = torch.randint(4, 256, (4, 32))
    with torch.inference_mode():
        a, b = fp16.model(input_ids=ids).logits, int8.model(input_ids=ids).logits
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9
    assert torch.allclose(a, b, atol=0.1 * a.abs().max().item())
