"""A user's own GGUF models, given as bare files (no tokenizer beside them): read from their headers,
never de-quantised to be served or to draft; the drafter not loaded at all with --cloud-only; a pair
whose vocabularies differ refused in one line before any weights load; a compact drafter exported as
a GGUF of its own. On bare copies of the embedded target's GGUF and of the embedded drafter, exported."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import require_embedded
from hybridspec.common.config import ConfigError

pytestmark = pytest.mark.embedded
PROMPT = "def fibonacci(n):"


def bare_copy(src: Path, into: Path, name: str | None = None) -> Path:
    """`src` alone in the new directory `into` (a hard link where possible: the test reads, never writes)."""
    into.mkdir(parents=True)
    dst = into / (name or src.name)
    try:
        os.link(src, dst)
    except OSError:
        import shutil

        shutil.copyfile(src, dst)
    return dst


@pytest.fixture(scope="module")
def bare(tmp_path_factory) -> dict[str, Path]:
    """The embedded target's GGUF (Q8_0) alone in a directory, its Q4_1 GGUF alone in another (a GGUF
    drafter of the same family), and the embedded drafter exported as a GGUF of its own; the pulled
    directories, for comparison."""
    require_embedded()
    from hybridspec.common.models.embedded import default_paths

    root = tmp_path_factory.mktemp("bare")
    paths = default_paths()
    return {"target": bare_copy(paths["target"] / "model.Q8_0.gguf", root / "target"),
            "q4": bare_copy(paths["target"] / "model.Q4_1.gguf", root / "q4"),
            "exported": root / "exported" / "drafter.gguf", "pulled": paths["target"], "compact": paths["drafter"]}


@pytest.fixture(scope="module")
def exported(bare) -> Path:
    """The embedded drafter exported as a GGUF of its own (`models export-drafter`), alone in a directory."""
    from hybridspec.common.models.drafter_gguf import export_drafter

    bare["exported"].parent.mkdir()
    return export_drafter(bare["compact"], bare["exported"], log=lambda msg: None)


@pytest.fixture
def tensor_reads(monkeypatch) -> list[str]:
    """Calls into what reads a GGUF's tensors: transformers' GGUF loader, gguf's reader and its
    de-quantiser. Spied, not replaced: they still run if called."""
    import gguf
    import gguf.quants
    import transformers.modeling_gguf_pytorch_utils as hf_gguf

    calls: list[str] = []
    for owner, name in ((hf_gguf, "load_gguf_checkpoint"), (gguf.quants, "dequantize")):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    real_init = gguf.GGUFReader.__init__
    monkeypatch.setattr(gguf.GGUFReader, "__init__",
                        lambda self, *a, **k: calls.append("GGUFReader") or real_init(self, *a, **k))
    return calls


def test_the_header_says_what_the_model_is_without_its_weights(bare):
    import gguf

    from hybridspec.common.models.gguf_file import read_header

    header = read_header(bare["target"])
    reference = gguf.GGUFReader(bare["target"])
    assert header.architecture == "llama" and header.context_length == 8192 and header.weight_type == "Q8_0"
    assert header.tokens == [str(bytes(p), "utf-8") for p in
                             (reference.fields["tokenizer.ggml.tokens"].parts[i]
                              for i in reference.fields["tokenizer.ggml.tokens"].data)]
    assert header.parameters == sum(int(t.n_elements) for t in reference.tensors)
    assert header.end_ids == (2,) and header.has_vocabulary
    assert not read_header(bare["compact"] / "drafter.gguf", strings=frozenset()).has_vocabulary


def test_not_a_gguf_is_one_line(tmp_path):
    from hybridspec.common.models.gguf_file import read_header

    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"not a model at all")
    with pytest.raises(ConfigError, match="is not a GGUF file"):
        read_header(fake)


def test_the_tokenizer_from_metadata_is_the_one_transformers_builds(bare, tmp_path, monkeypatch, tensor_reads):
    from transformers import AutoTokenizer

    from hybridspec.common.models import gguf_file
    from hybridspec.common.models.vocabulary import TokenizerFiles
    from hybridspec.edge.textcodec import TextCodec

    monkeypatch.setattr(gguf_file, "tokenizer_cache", lambda: tmp_path / "cache")
    directory = gguf_file.tokenizer_files(bare["target"])
    assert gguf_file.tokenizer_files(bare["target"]) == directory  # the second time from the cache
    assert tensor_reads == []
    files, codec = TokenizerFiles(directory), TextCodec(directory)
    reference = AutoTokenizer.from_pretrained(str(bare["target"].parent), gguf_file=bare["target"].name)
    pulled = TextCodec(bare["pulled"])  # what every pulled edge and cloud fingerprint
    assert files.fingerprint() == codec.fingerprint() == pulled.fingerprint()
    for text in ("Hello world!  def f(x):\n    return x**2  # 12345", "héllo <|im_start|>user 你好"):
        assert codec.encode(text) == reference.encode(text, add_special_tokens=False) == pulled.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert codec.render_chat(messages) == reference.apply_chat_template(messages, tokenize=False,
                                                                        add_generation_prompt=True)
    assert files.eos_token_id == reference.eos_token_id == 2


@pytest.mark.parametrize("kind", ["BPE", "Unigram", "WordPiece"])
def test_a_vocabulary_read_as_json_is_the_tokenizers_own(tmp_path, kind):
    """TokenizerFiles reads the vocabulary from tokenizer.json's text (no Tokenizer built): the same
    token -> id map `tokenizers` gives, added tokens included, for each way tokenizer.json stores it."""
    from tokenizers import Tokenizer, models

    from hybridspec.common.models.vocabulary import TokenizerFiles

    words = {"a": 0, "b": 1, "ab": 2, "[UNK]": 3, "héllo": 4}
    model = {"BPE": lambda: models.BPE(words, [("a", "b")], unk_token="[UNK]"),
             "Unigram": lambda: models.Unigram([(w, -float(i)) for w, i in words.items()], unk_id=3),
             "WordPiece": lambda: models.WordPiece(words, unk_token="[UNK]")}[kind]()
    tokenizer = Tokenizer(model)
    tokenizer.add_special_tokens(["<|end|>", "ab"])  # one new, one already in the vocabulary
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>"}))
    files = TokenizerFiles(tmp_path)
    assert files.get_vocab() == Tokenizer.from_file(str(tmp_path / "tokenizer.json")).get_vocab(with_added_tokens=True)
    assert files.eos_token_id == 5
    assert "tokenizer" not in vars(files)  # the Tokenizer itself was never built


def test_a_bare_gguf_target_is_served_without_transformers_or_its_tensors_read(bare, tmp_path):
    """The replica's own load, in a process of its own, the first time this file is served (an empty
    $HYBRIDSPEC_HOME): llama.cpp maps the file, the tokenizer comes from the header (made in a child
    process), and transformers (some 60 MB held, and 2 s of imports) is never imported here; nor is a
    `tokenizers` Tokenizer built (some 40 MB held for the replica's life): the fingerprint and the
    end-of-sequence id come from tokenizer.json's text."""
    script = f"""
import json, sys
from hybridspec.cloud.core.verifier import Verifier, VerifierLimits
from hybridspec.cloud.engine.factory import load_engine
from hybridspec.cloud.engine.kinds import EngineKind
from hybridspec.common.config import DType
limits = VerifierLimits(max_context=512, kv_cache_tokens=512, kv_streams=1, max_sessions=1)
target, engine = load_engine({str(bare['target'])!r}, EngineKind.AUTO, "auto", DType.AUTO, 1, limits)
info = Verifier(target, limits, engine).info
print(json.dumps({{"transformers": "transformers" in sys.modules, "gguf": "gguf" in sys.modules,
                  "tokenizers": "tokenizers" in sys.modules,
                  "fingerprint": info.tokenizer_fingerprint, "eos": list(info.eos_token_ids), "engine": engine.capabilities.name}}))
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HYBRIDSPEC_HOME": str(tmp_path)})
    assert run.returncode == 0, run.stderr[-2000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(list((tmp_path / "gguf-tokenizers").glob("*/tokenizer.json"))) == 1  # made now, from the header
    from hybridspec.edge.textcodec import TextCodec

    assert seen == {"transformers": False, "gguf": False, "tokenizers": False,
                    "fingerprint": TextCodec(bare["pulled"]).fingerprint(),
                    "eos": [2], "engine": "llamacpp"}


def test_a_bare_gguf_drafter_drafts_on_llamacpp_without_its_tensors_read(bare, tmp_path, tensor_reads, llama_engine):
    """The target's own GGUF as a drafter: llama.cpp runs it fed ids, nothing is de-quantised, and its
    greedy block is the target engine's greedy continuation."""
    from hybridspec.cloud.engine.base import Feed
    from hybridspec.common.models.loading import load_drafter
    from hybridspec.common.protocol.wire import SamplingParams
    from hybridspec.edge.drafters import make_drafter
    from hybridspec.edge.proposal import DraftSettings, DrafterKind
    from hybridspec.edge.textcodec import TextCodec

    drafter_file = bare_copy(bare["target"], tmp_path / "drafter", "drafter.gguf")
    loaded = load_drafter(drafter_file, "cpu")
    assert tensor_reads == []
    assert loaded.model is None and loaded.llama.embeddings is None and loaded.llama.head_rows == 49152
    assert loaded.vocab_size == 49152 and loaded.eos_token_ids == (2,)
    settings = DraftSettings(sampling=SamplingParams(temperature=0.0), vocab_size=49152, stop_ids=frozenset(),
                             max_context=1024)
    prompt = TextCodec(bare["pulled"]).encode(PROMPT)
    block = make_drafter(DrafterKind.MODEL, loaded, settings).propose(prompt, 8, fallback=False).ids
    kv = llama_engine.new_sequence()
    try:
        llama_engine.reserve(kv, len(prompt) + 8)
        llama_engine.forward([Feed(kv, prompt[:-1], scored=False)])
        greedy, token = [], prompt[-1]
        for _ in range(8):
            token = int(llama_engine.forward([Feed(kv, [token], scored=True)])[0].logits[-1].argmax())
            greedy.append(token)
    finally:
        llama_engine.release(kv)
    assert block == greedy


def test_a_compact_drafters_own_gguf_is_a_model_of_its_own(bare, exported):
    """`models export-drafter`: the drafter's layers with the target's embeddings and tokenizer, which
    llama.cpp runs fed ids, scoring the compact drafter's head rows as the compact drafter does."""
    import numpy as np

    from hybridspec.common.models.gguf_file import read_header, tokenizer_files
    from hybridspec.common.models.loading import load_drafter, load_model
    from hybridspec.common.models.pairing import describe
    from hybridspec.common.models.vocabulary import TokenizerFiles
    from hybridspec.common.protocol.wire import SamplingParams
    from hybridspec.edge.drafters import make_drafter
    from hybridspec.edge.proposal import DraftSettings, DrafterKind

    header = read_header(exported, strings=frozenset())
    assert header.arch_value("block_count") == 4 and header.has_vocabulary and header.vocab_size == 49152
    assert TokenizerFiles(tokenizer_files(exported)).fingerprint() == describe(str(bare["pulled"])).tokenizer.fingerprint()
    settings = DraftSettings(sampling=SamplingParams(temperature=0.0), vocab_size=49152, stop_ids=frozenset(),
                             max_context=1024)
    mine = make_drafter(DrafterKind.MODEL, load_drafter(exported, "cpu"), settings).lm
    compact_model = load_model(bare["compact"], "cpu")
    compact = make_drafter(DrafterKind.MODEL, compact_model, settings).lm
    head = compact_model.head_ids.numpy()
    rng = np.random.default_rng(0)
    for _ in range(4):
        context = rng.integers(100, 40000, 24).tolist()
        a, b = mine.advance(context).numpy()[head], compact.advance(context).numpy()[head]
        # The same Q8_0 layers; the embeddings and head from the target's Q8_0 GGUF here, from its shipped
        # Q4_1 in the compact drafter: 0.57 apart at most here, where logits reach 18 (a head row mapped
        # to the wrong id, or a layer left out, is whole units off).
        assert np.abs(a - b).max() < 1.0
        assert a[b.argmax()] > a.max() - 1.0  # the compact drafter's pick is the exported one's, or a near-tie


def test_a_compact_drafters_converted_head_alone_is_refused_in_one_line(bare):
    from hybridspec.common.models.loading import load_drafter

    with pytest.raises(ConfigError, match="export-drafter"):
        load_drafter(bare["compact"] / "drafter.gguf", "cpu")


def test_pairs_are_compared_file_to_file(bare, exported, tmp_path, model_dirs):
    from hybridspec.common.models.pairing import PairMismatch, check_pair, describe

    target = describe(str(bare["target"]))
    fit = check_pair(target, describe(str(exported)), 4096)
    assert fit.vocab_size == 49152 and fit.same_chat_template and fit.notes == ()
    assert check_pair(target, describe(str(bare["compact"])), 4096).same_chat_template
    longer = check_pair(target, describe(str(exported)), 16384)
    assert any("exceeds the 8192 tokens the target" in n for n in longer.notes)
    assert any("the drafter was trained for 8192" in n for n in longer.notes)
    from tinymodels import save_gguf

    other = describe(str(save_gguf(tmp_path / "other.gguf")))
    with pytest.raises(PairMismatch, match="token id 0 is '<|endoftext|>' to the target and 'a' to the drafter"):
        check_pair(target, other, 4096)
    tiny, alien = describe(str(model_dirs["target"])), describe(str(model_dirs["alien"]))
    with pytest.raises(PairMismatch, match="token id 4 is 'w4' to the target and 'v4' to the drafter"):
        check_pair(tiny, alien, 512)


def test_a_mismatched_pair_check_is_one_line_before_any_weights_load(bare, tmp_path):
    """`pair check` with a drafter of another family: one line, exit 2, and neither model was loaded
    (the process never imported llama.cpp or torch)."""
    from tinymodels import save_gguf

    (tmp_path / "drafter").mkdir()
    other = save_gguf(tmp_path / "drafter" / "other.gguf")
    script = f"""
import sys
from hybridspec.cli.main import main
code = main(["pair", "check", "--target", {str(bare['target'])!r}, "--drafter", {str(other)!r}])
print("loaded:", "llama_cpp" in sys.modules, "torch" in sys.modules)
sys.exit(code)
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stdout.strip() == "loaded: False False"
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hybridspec: error: the drafter cannot draft for this target: "
                                                   "token id 0 is '<|endoftext|>' to the target and 'a'"), run.stderr


@pytest.fixture(scope="module")
def bare_server(bare):
    """The bare target served in-process on llama.cpp, over real gRPC."""
    from hybridspec.cloud.api.server import BackgroundServer
    from hybridspec.cloud.core.verifier import Verifier, VerifierLimits
    from hybridspec.cloud.engine.factory import load_engine
    from hybridspec.cloud.engine.kinds import EngineKind
    from hybridspec.common.config import DType

    limits = VerifierLimits(max_context=1024, kv_cache_tokens=2048, kv_streams=2, max_sessions=4)
    target, engine = load_engine(str(bare["target"]), EngineKind.AUTO, "auto", DType.AUTO, 1, limits)
    server = BackgroundServer(Verifier(target, limits, engine))
    yield server
    server.stop()


def test_cloud_only_loads_no_drafter(bare, bare_server):
    """`edge generate --cloud-only` with a drafter configured: the drafter is never loaded (the
    process never imports torch or llama.cpp), and the text is the one the default edge writes."""
    def generate(*flags: str) -> tuple[dict, list[str]]:
        script = f"""
import sys
from hybridspec.cli.main import main
code = main(["edge", "generate", "--cloud", {bare_server.address!r}, "--drafter", {str(bare['q4'])!r},
             "--prompt", {PROMPT!r}, "--max-new-tokens", "12", "--json", *{list(flags)!r}])
print("loaded:", "torch" in sys.modules, "llama_cpp" in sys.modules)
sys.exit(code)
"""
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        out = run.stdout.strip().splitlines()
        return json.loads(out[0]), out[1:]

    alone, loaded = generate("--cloud-only")
    assert loaded == ["loaded: False False"]
    assert alone["stats"]["cloud_only_tokens"] == len(alone["token_ids"]) == 12
    hybrid, _ = generate("--no-cloud-only-switch")
    assert hybrid["stats"]["rounds"] > 0 and hybrid["token_ids"] == alone["token_ids"]


def test_cloud_only_worker_holds_no_drafter(bare, bare_server):
    from hybridspec.cli.edge_options import build_worker
    from hybridspec.common.protocol.errors import FailedPrecondition
    from hybridspec.edge.config import EdgeConfig

    worker = build_worker(EdgeConfig.of(cloud=bare_server.address, drafter=str(bare["q4"]), cloud_only=True,
                                        max_new_tokens=6), background=True)
    try:
        generation = worker.generate(worker.codec.encode(PROMPT))
        assert len(generation.token_ids) == 6 and not worker.load.ready() and not worker.load.pending()
        with pytest.raises(FailedPrecondition, match="--cloud-only loads no drafter"):
            worker.load.get()
    finally:
        worker.close()


SERVE = """
import sys
from hybridspec.cli.main import main
code = main(sys.argv[1:])
print("loaded:", "torch" in sys.modules, "transformers" in sys.modules, "llama_cpp" in sys.modules, flush=True)
sys.exit(code)
"""


def test_a_cloud_only_edge_server_loads_no_drafter(bare, bare_server):
    """`edge serve --cloud-only` with a GGUF drafter configured: the drafter is never loaded (the
    server never imports torch, transformers or llama.cpp, nor maps the drafter's file), and a chat
    prompt is the one Hugging Face's tokenizer makes, control tokens typed by the user included."""
    import signal

    import httpx2
    from transformers import AutoTokenizer

    from hybridspec.cli.edge_options import build_worker
    from hybridspec.cli.serve_cmd import parse_ready_line
    from hybridspec.edge.config import EdgeConfig
    from hybridspec.edge.prompt import encode_messages

    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "fibonacci<|im_end|>\n<|im_start|>assistant\nsure"}]
    hf = AutoTokenizer.from_pretrained(bare["pulled"])
    chat_ids, text_ids = encode_messages(hf, messages), hf(PROMPT, add_special_tokens=False)["input_ids"]
    reference = build_worker(EdgeConfig.of(cloud=bare_server.address, drafter=str(bare["q4"]), cloud_only=True,
                                           max_new_tokens=12), background=True)
    try:
        chat_text = reference.generate(chat_ids).text
        completion = reference.generate(text_ids).text
    finally:
        reference.close()
    stop = completion.split()[2]
    proc = subprocess.Popen([sys.executable, "-c", SERVE, "edge", "serve", "--cloud", bare_server.address,
                             "--drafter", str(bare["q4"]), "--cloud-only", "--port", "0", "--max-new-tokens", "12"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        base = parse_ready_line(proc.stdout.readline())
        assert base, proc.stderr.read() if proc.poll() is not None else "no ready line"
        model = httpx2.get(f"{base}/v1/models").json()["data"][0]["id"]
        chat = httpx2.post(f"{base}/v1/chat/completions", json={"model": model, "messages": messages}, timeout=60)
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["prompt_tokens"] == len(chat_ids)
        assert chat.json()["choices"][0]["message"]["content"] == chat_text
        cut = httpx2.post(f"{base}/v1/completions", json={"model": model, "prompt": PROMPT, "stop": [stop]},
                          timeout=60).json()
        assert cut["choices"][0]["text"] == completion[:completion.index(stop)]
        assert cut["choices"][0]["finish_reason"] == "stop"
        assert str(bare["q4"].resolve()) not in Path(f"/proc/{proc.pid}/maps").read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert proc.stdout.read().strip() == "loaded: False False False"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_an_edge_whose_drafter_cannot_draft_for_the_cloud_fails_before_loading_it(bare_server, tmp_path):
    """`edge generate` with a GGUF drafter of another vocabulary: one line, before the drafter's
    weights load (the process never imported torch or llama.cpp)."""
    from tinymodels import save_gguf

    (tmp_path / "other").mkdir()
    other = save_gguf(tmp_path / "other" / "other.gguf")
    script = f"""
import sys
from hybridspec.cli.main import main
code = main(["edge", "generate", "--cloud", {bare_server.address!r}, "--drafter", {str(other)!r}, "--prompt", "ab"])
print("loaded:", "torch" in sys.modules, "llama_cpp" in sys.modules)
sys.exit(code)
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and run.stdout.strip() == "loaded: False False", run.stderr[-2000:]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "drafter and target must share one tokenizer" in lines[0], run.stderr


def test_export_takes_what_it_needs_from_a_bare_gguf_target(bare, tmp_path):
    """A drafter distilled from a bare GGUF target refers to that file; export-drafter copies the
    embeddings and the tokenizer from it."""
    import shutil

    from hybridspec.common.models.drafter_gguf import export_drafter
    from hybridspec.common.models.gguf_file import read_header, tokenizer_files
    from hybridspec.common.models.vocabulary import TokenizerFiles

    compact = tmp_path / "compact"
    shutil.copytree(bare["compact"], compact)
    manifest = json.loads((compact / "hybridspec-drafter.json").read_text())
    (compact / "hybridspec-drafter.json").write_text(json.dumps({**manifest, "base": str(bare["target"])}))
    out = export_drafter(compact, tmp_path / "drafter.gguf", "F16", log=lambda msg: None)
    header, target = read_header(out), read_header(bare["target"])
    assert header.tokens == target.tokens and header.weight_type == "F16" and header.arch_value("block_count") == 4
    assert header.raw_data(header.tensor("token_embd.weight")) == target.raw_data(target.tensor("token_embd.weight"))
    assert TokenizerFiles(tokenizer_files(out)).fingerprint() == TokenizerFiles(tokenizer_files(bare["target"])).fingerprint()


def test_a_bare_gguf_loaded_into_torch_says_what_it_costs_first(bare, capsys):
    """The torch engine and distillation still read a GGUF's tensors (load_model), saying first what
    that takes; `load_drafter` is the one that leaves a GGUF to llama.cpp."""
    from hybridspec.common.models.loading import load_model

    loaded = load_model(bare["target"], "cpu")
    assert loaded.model is not None and loaded.vocab_size == 49152 and loaded.eos_token_ids == (2,)
    said = capsys.readouterr().err
    assert "de-quantising its 272 tensors to float32, 513 MiB of memory" in said
