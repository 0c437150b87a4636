"""A tokenizer directory read without transformers: its vocabulary, special tokens and chat template.

What both sides know a tokenizer by (its fingerprint: common/protocol/fingerprints.py), what the edge's
torch-free TextCodec encodes with (edge/textcodec.py), what a replica serving a GGUF on llama.cpp
reports (cloud/engine/factory.py), and what `pair check` compares before any weights load
(common/models/pairing.py). The special tokens are those Hugging Face's `all_special_tokens` lists for
the same directory: the named ones (bos, eos, unk, ...) and the additional ones, in that order.
"""
from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

from ..protocol.fingerprints import fingerprint

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TokenizerFiles:
    """A directory's tokenizer.json, tokenizer_config.json and chat template: the vocabulary read as JSON,
    encoding and decoding with `tokenizers`."""

    def __init__(self, directory: str | Path) -> None:
        """FileNotFoundError when `directory` holds no tokenizer.json."""
        d = Path(directory)
        if not (d / TOKENIZER_FILE).is_file():
            raise FileNotFoundError(f"no {TOKENIZER_FILE} in {d}")
        self.directory = d
        self.config: dict = json.loads((d / CONFIG_FILE).read_text()) if (d / CONFIG_FILE).is_file() else {}
        template = self.config.get("chat_template")
        if (d / TEMPLATE_FILE).is_file():
            template = (d / TEMPLATE_FILE).read_text()
        self.chat_template: str | None = template if isinstance(template, str) else None
        # The named special tokens (bos_token, eos_token, ...) by name, as the config spells them.
        self.named = {k: _content(v) for k, v in self.config.items() if k.endswith("_token") and _content(v)}
        extra = self.config.get("extra_special_tokens") or self.config.get("additional_special_tokens") or []
        named = [self.named[k] for k in SPECIAL_NAMES if k in self.named]
        self.special_tokens = tuple(dict.fromkeys(named + [_content(t) for t in extra if _content(t)]))

    @cached_property
    def tokenizer(self):
        """The `tokenizers` Tokenizer, built on first use: only encoding and decoding need it. A replica
        serving a GGUF on llama.cpp needs just the vocabulary, read as JSON: the Tokenizer would hold
        some 40 MB for a 49,152-token vocabulary for the replica's life (more for larger ones)."""
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(self.directory / TOKENIZER_FILE))

    def get_vocab(self) -> dict[str, int]:
        """Token text -> id, added tokens included (Hugging Face's get_vocab), read from tokenizer.json's
        text; a model kind whose vocabulary is stored otherwise is asked of the Tokenizer."""
        model = json.loads((self.directory / TOKENIZER_FILE).read_text(encoding="utf-8"))
        added, model = model.get("added_tokens") or [], model.get("model") or {}
        vocab = model.get("vocab")
        if model.get("type") == "Unigram" and isinstance(vocab, list):  # [piece, score] pairs: the id is the place
            vocab = {entry[0]: i for i, entry in enumerate(vocab)}
        elif not isinstance(vocab, dict):
            return self.tokenizer.get_vocab(with_added_tokens=True)
        vocab.update({t["content"]: t["id"] for t in added})
        return vocab

    @property
    def all_special_tokens(self) -> list[str]:
        """The special tokens (Hugging Face's all_special_tokens)."""
        return list(self.special_tokens)

    @property
    def eos_token_id(self) -> int | None:
        """The end-of-sequence token's id, if the config names one."""
        eos = self.named.get("eos_token")
        return None if eos is None else self.get_vocab().get(eos)

    def fingerprint(self) -> str:
        """common.models.loading.tokenizer_fingerprint of the Hugging Face tokenizer of this directory."""
        return fingerprint(self.get_vocab(), self.special_tokens)


def _content(value) -> str:
    """A special token's text, whether the config holds it as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""
