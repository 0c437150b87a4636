"""Text on the edge: the torch-free codec against Hugging Face's tokenizer, stop strings (unit and end
to end over gRPC), and a worker whose drafter loads in the background while the cloud decodes."""
import threading

import pytest
from transformers import AutoTokenizer

from hybridspec.common.models.embedded import default_paths
from hybridspec.common.models.loading import tokenizer_fingerprint
from hybridspec.edge.client import VerifierClient
from hybridspec.edge.config import EdgeConfig
from hybridspec.edge.startup import DrafterLoad
from hybridspec.edge.stops import TextTracker
from hybridspec.edge.textcodec import TextCodec, tokenizer_dir
from hybridspec.edge.worker import EdgeWorker

from conftest import require_embedded

from tinymodels import greedy_reference

PROMPT = [5, 17, 33, 80]
NEW = 40
TEXTS = ["The sea is blue.\n\nAnd the sky?", "naïve café — 東京 🌊", "", "w5 w6 w7 w8"]


def _same_as_hf(directory, hf_tokenizer):
    codec = TextCodec(directory)
    assert codec.fingerprint() == tokenizer_fingerprint(hf_tokenizer)
    for text in TEXTS:
        ids = codec.encode(text)
        assert ids == hf_tokenizer(text, add_special_tokens=False)["input_ids"]
        assert codec.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    messages = [{"role": "user", "content": "w5 w9"}]
    expected = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert codec.encode_chat(messages) == list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    # Control tokens typed by a user (and the markers that set them apart) are encoded as plain text,
    # to the ids Hugging Face's sanitised encoding gives (unsanitised, they would be control tokens);
    # a token plain text cannot avoid is refused by both.
    for token in [t.content for t in hf_tokenizer.added_tokens_decoder.values()]:
        forged = [{"role": "system", "content": f"w9 {token}"},
                  {"role": "user", "content": f"w5{token}\U000f0000{token}\U000f0001 w6 {token}"}]
        try:
            sanitised = hf_tokenizer.apply_chat_template(forged, add_generation_prompt=True,
                                                         sanitize_control_tokens=True)
        except ValueError:
            with pytest.raises(ValueError, match="cannot encode"):
                codec.encode_chat(forged)
            continue
        plain = hf_tokenizer.apply_chat_template(forged, add_generation_prompt=True)
        sanitised, plain = (list(e["input_ids"] if hasattr(e, "keys") else e) for e in (sanitised, plain))
        assert codec.encode_chat(forged) == sanitised != plain


def test_codec_matches_hugging_face_on_a_tiny_tokenizer(model_dirs, target):
    _same_as_hf(model_dirs["target"], target.tokenizer)


@pytest.mark.embedded
def test_codec_matches_hugging_face_on_the_embedded_tokenizer():
    require_embedded()
    directory = tokenizer_dir(default_paths()["drafter"])  # a compact drafter: its target's tokenizer
    assert directory == default_paths()["target"]
    _same_as_hf(directory, AutoTokenizer.from_pretrained(directory))
    # Released token by token (multi-byte characters split across tokens), the text is the whole decode.
    codec = TextCodec(directory)
    ids = codec.encode(" ".join(TEXTS) * 3)
    tracker = TextTracker(codec)
    released = "".join(tracker.add([i])[1] for i in ids) + tracker.finish()
    assert released == codec.decode(ids)


class Chars:
    """A decoder where token i is the i-th character of an alphabet (so boundaries are visible)."""

    def __init__(self, alphabet: str) -> None:
        self.alphabet = alphabet

    def decode(self, ids):
        return "".join(self.alphabet[i] for i in ids)


def test_stop_string_across_tokens_ends_before_it():
    text = "hello STOP there"
    tracker = TextTracker(Chars(text), ("STOP",))
    released = ""
    kept = []
    for start in range(0, len(text), 3):
        ids = list(range(start, min(start + 3, len(text))))
        keep, out = tracker.add(ids)
        kept += ids[:keep]
        released += out
        if tracker.stopped:
            break
    released += tracker.finish()
    assert released == "hello " and tracker.stopped
    assert "".join(text[i] for i in kept).endswith("STOP")  # tokens up to the one completing it


def test_text_that_could_start_a_stop_string_is_held_back():
    text = "ab<en"
    tracker = TextTracker(Chars(text), ("<end>",))
    keep, out = tracker.add([0, 1, 2, 3, 4])
    assert keep == 5 and out == "ab" and not tracker.stopped
    assert tracker.finish() == "<en"  # the generation ended without the stop string


def test_incomplete_characters_are_held_back():
    tracker = TextTracker(Chars("ab\ufffd"))
    assert tracker.add([0, 1, 2]) == (3, "ab")


def test_stop_string_in_a_real_generation(server, target, random_drafter):
    """The text ends right before the stop string; the tokens before it are the target's."""
    reference = greedy_reference(target, PROMPT, NEW)
    full_text = target.tokenizer.decode(reference, skip_special_tokens=True)
    words = full_text.split()
    stop = " ".join(words[len(words) // 2: len(words) // 2 + 2])
    config = EdgeConfig.of(cloud=server.address, max_new_tokens=NEW, max_draft=4, stop=(stop,), cloud_only_switch=False)
    with VerifierClient(server.address) as client:
        gen = EdgeWorker(random_drafter, client, config).stream(PROMPT)
        streamed = "".join(event.text for event in gen)
    assert gen.text == streamed == full_text[:full_text.index(stop)]
    assert gen.finish_reason == "stop" and gen.token_ids == reference[:len(gen.token_ids)]
    assert len(gen.token_ids) < NEW


def test_drafter_loading_in_the_background(server, target, model_dirs):
    """Generation starts with the cloud decoding alone while the drafter loads, then takes the drafter
    up (here it only guesses along: the tiny pair cannot beat cloud-only); the output stays the target's."""
    config = EdgeConfig.of(cloud=server.address, drafter=str(model_dirs["target"]), max_new_tokens=NEW, max_draft=4,
                           fallback_threshold=0.0, probe_tokens=4, device="cpu")
    gate = threading.Event()
    load = DrafterLoad()
    threading.Thread(target=lambda: (gate.wait(30), load._run(config.model)), daemon=True).start()
    with VerifierClient(server.address) as client:
        worker = EdgeWorker(load, client, config, codec=TextCodec(model_dirs["target"]))
        gen = worker.stream(PROMPT)
        events = iter(gen)
        first = next(events)  # the first token arrives before the drafter exists
        assert first.tokens and not load.ready()
        gate.set()
        list(events)
    assert gen.token_ids == greedy_reference(target, PROMPT, NEW)
    assert gen.stats.cloud_only_tokens >= 1 and gen.drafter is not None


def test_concurrent_generations_share_one_worker(server, target, random_drafter):
    config = EdgeConfig.of(cloud=server.address, max_new_tokens=NEW, max_draft=4, cloud_only_switch=False)
    prompts = [PROMPT, [9, 8, 7], [40, 41], [100, 3, 3, 3]]
    results = {}
    with VerifierClient(server.address) as client:
        worker = EdgeWorker(random_drafter, client, config)
        threads = [threading.Thread(target=lambda p=p: results.__setitem__(tuple(p), worker.generate(p)))
                   for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        worker.close()
    for p in prompts:
        assert results[tuple(p)].token_ids == greedy_reference(target, p, NEW)


class Words:
    """A decoder that joins words with spaces, as a word-level tokenizer does."""

    def decode(self, ids):
        return " ".join(f"w{i}" for i in ids)


def test_separators_survive_empty_commits_and_unverified_tails():
    tracker = TextTracker(Words())
    out = tracker.add([5, 6])[1] + tracker.add([])[1] + tracker.add([7])[1] + tracker.finish()
    assert out == "w5 w6 w7"
    assert tracker.continuation([8, 9]) == " w8 w9"
