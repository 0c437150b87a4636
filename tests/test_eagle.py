"""The EAGLE drafter: trained on the tiny target's features, drafting from the features the real
gRPC verifier sends, lossless in greedy mode and distribution-exact when sampling."""
import json
import statistics

import pytest
import torch
from safetensors import safe_open
from scipy.stats import chisquare

from hybridspec.cloud.core.verifier import Verifier, VerifierLimits
from hybridspec.common.models.compact import MANIFEST, WEIGHTS
from hybridspec.common.maths.features import encode_features
from hybridspec.common.models.loading import load_model
from hybridspec.common.protocol.wire import FeatureFormat, SamplingParams
from hybridspec.distill.config import DistillConfig
from hybridspec.distill.train import distill
from hybridspec.edge.client import VerifierClient
from hybridspec.edge.config import EdgeConfig
from hybridspec.edge.drafter import NgramDrafter
from hybridspec.edge.proposal import DraftSettings, Drafting
from hybridspec.edge.eagle import EagleDrafter, FeatureLog
from hybridspec.edge.worker import EdgeWorker
from hybridspec.lab.baselines import colocated

from tinymodels import EVERY_ROUND, VOCAB, greedy_reference

PROMPT = [5, 17, 33, 80, 41, 9]


@pytest.fixture(scope="module")
def eagle_dir(model_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("eagle")
    report = distill(DistillConfig(target=str(model_dirs["target"]), out=str(out), kind="eagle", steps=60,
                                   generate=32, self_instruct=8, temperatures="0,1", max_new_tokens=24, heldout=4,
                                   eval_every=30, head_size=128, batch_tokens=256, lr=3e-3, seed=0))
    return out, report


@pytest.fixture(scope="module")
def eagle(eagle_dir):
    return load_model(eagle_dir[0], device="cpu")


@pytest.fixture(scope="module")
def chat_prompt(eagle_dir):
    """A prompt of the shape the head was trained on (the tiny tokenizer turns words into <unk>, so
    an arbitrary id sequence would be far outside what it saw)."""
    first = json.loads((eagle_dir[0] / "train-samples.jsonl").read_text().splitlines()[0])
    return first["ids"][: first["start"]]


def features_of(target, ids):
    """The target's teacher-forced features at every position of `ids` but the last."""
    with torch.inference_mode():
        hidden = target.model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    return hidden[:-1]


def settings(**kw):
    return DraftSettings(**{"sampling": SamplingParams(), "vocab_size": VOCAB, "stop_ids": frozenset(),
                            "drafting": Drafting(fallback_threshold=0.0), **kw})


def test_training_lowers_the_loss_and_the_checkpoint_holds_only_the_head(eagle_dir, eagle):
    out, report = eagle_dir
    assert statistics.mean(report["losses"][-10:]) < statistics.mean(report["losses"][:5])
    assert report["curve"][-1]["agreement"] > report["curve"][0]["agreement"]
    assert json.loads((out / MANIFEST).read_text())["kind"] == "eagle"
    with safe_open(out / WEIGHTS, framework="pt") as f:
        stored = set(f.keys())
    assert "fc.weight" in stored and "head_ids" in stored
    assert not any("embed" in k or "lm_head" in k for k in stored)  # the target's, read from its files
    assert (out / "train-features.safetensors").is_file()
    assert eagle.is_eagle and eagle.head_ids.numel() == 128


def test_incremental_drafting_equals_drafting_from_scratch(eagle, target):
    """The head's cache (true features reused, bridged positions cut) changes nothing: every proposal
    equals the one a fresh drafter makes for the same context and features."""
    ids = PROMPT + greedy_reference(target, PROMPT, 30)
    feats = features_of(target, ids)
    kept = EagleDrafter(eagle, settings(), FeatureLog(), NgramDrafter(SamplingParams()))
    for end, known in [(8, 7), (10, 9), (13, 9), (12, 11), (20, 19), (26, 20), (25, 24)]:
        block = encode_features(feats[:known], 0, FeatureFormat.FP16)
        kept.log.add(block)
        fresh = EagleDrafter(eagle, settings(), FeatureLog(), NgramDrafter(SamplingParams()))
        fresh.log.add(block)
        assert kept.propose(ids[:end], 4, fallback=False).ids == fresh.propose(ids[:end], 4, fallback=False).ids


def test_without_features_the_fallback_drafts_and_says_so(eagle, target):
    drafter = EagleDrafter(eagle, settings(), FeatureLog(), NgramDrafter(SamplingParams()))
    context = [5, 6, 7, 5, 6]
    assert drafter.propose(context, 2).ids == [7, 5]  # prompt lookup
    assert "NgramDrafter" in drafter.notice
    drafter.notice = ""
    drafter.log.add(encode_features(features_of(target, context), 0, FeatureFormat.INT8))
    drafter.propose(context, 2)
    assert "features again" in drafter.notice


@pytest.mark.parametrize("features", ["int8", "fp16"])
def test_greedy_output_is_the_targets_over_grpc(server, target, eagle, chat_prompt, features):
    config = EdgeConfig.of(cloud=server.address, max_new_tokens=40, max_draft=4, features=features,
                           fallback_threshold=0.0, **EVERY_ROUND)
    with VerifierClient(server.address) as client:
        gen = EdgeWorker(eagle, client, config).stream(chat_prompt)
        events = list(gen)
    assert gen.token_ids == greedy_reference(target, chat_prompt, 40)
    assert gen.stats.accepted > 0, gen.stats  # the head learnt something from the features
    assert gen.eagle.log.count == len(chat_prompt) + len(gen.token_ids) - 1  # every committed position but the newest
    per_vector = 64 + 2 if features == "int8" else 2 * 64
    assert gen.stats.feature_bytes == per_vector * gen.eagle.log.count
    assert gen.stats.feature_bytes < gen.stats.downlink_bytes
    assert not [e for e in events if e.message and "features" in e.message]  # never fell back


@pytest.mark.slow
def test_sampling_with_the_eagle_drafter_is_distributed_as_the_target(target, eagle, chat_prompt):
    """The first token of sampled generations (drafted from features, then accepted or corrected) is
    distributed as the target's p: the q the edge sends is exactly what it sampled from."""
    verifier = Verifier(target, VerifierLimits(max_context=64, max_draft=4, max_sessions=4))
    with torch.inference_mode():
        p = torch.softmax(target.model(input_ids=torch.tensor([chat_prompt])).logits[0, -1].float(), -1)
    runs = 1500
    counts = torch.zeros(VOCAB)
    accepted = 0
    for seed in range(runs):
        cfg = EdgeConfig.of(max_new_tokens=2, max_draft=1, temperature=1.0, seed=seed, fallback_threshold=0.0,
                            wire_top_k=0, **EVERY_ROUND)
        run = colocated(verifier, eagle, chat_prompt, cfg)
        counts[run.tokens[0]] += 1
        accepted += run.stats["accepted"]
    assert accepted > runs * 0.1  # the drafts were really used
    big = p * runs >= 5  # chi-square needs expected counts of 5 or more: pool the rest
    observed = torch.cat([counts[big], counts[~big].sum()[None]]).double().numpy()
    expected = torch.cat([p[big], p[~big].sum()[None]]).double().numpy()
    expected *= observed.sum() / expected.sum()
    assert chisquare(observed, expected).pvalue > 1e-3


def test_a_head_warm_started_from_a_plain_drafter_predicts_what_it_does(model_dirs, target, tmp_path):
    """fc = [0 | I] over the plain drafter's layers: whatever the features, the head's logits are the
    plain drafter's on the same tokens (which is where `--init` training starts from)."""
    from hybridspec.common.models.compact import Manifest
    from hybridspec.distill.eagle import build_head
    from hybridspec.distill.student import build_student, own_state, save_compact

    torch.manual_seed(0)
    student = build_student(target.model, 1, torch.arange(4, 132))
    for p in student.model.layers.parameters():
        p.data += 0.05 * torch.randn_like(p)  # any plain drafter, not just a copy of the target's layer
    save_compact(own_state(student), torch.arange(4, 132), tmp_path / "plain",
                 Manifest(base=str(model_dirs["target"]), num_layers=1, base_tokenizer_fingerprint=""))
    plain = load_model(tmp_path / "plain", device="cpu")
    head = build_head(target, torch.arange(VOCAB), plain).eval()
    assert torch.equal(head.head_ids, plain.head_ids.cpu())
    ids = torch.tensor([PROMPT + [7, 8, 9]])
    positions = torch.arange(1, ids.shape[1])[None]
    with torch.inference_mode():
        expected = plain.model(input_ids=ids[:, 1:], position_ids=positions).logits
        got = head.logits(head(torch.randn(1, ids.shape[1] - 1, head.hidden_size), ids[:, 1:], positions))
    assert torch.allclose(got, expected, atol=1e-4)
