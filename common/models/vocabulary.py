"""A tokenizer directory read without transformers: its vocabulary, special tokens and chat template.

What both sides know a tokenizer by (its fingerprint: common/protocol/fingerprints.py), what the edge's
torch-free TextCodec encodes with (edge/textcodec.py), what a replica serving a GGUF on llama.cpp
reports (cloud/engine/factory.py), and what `pair check` compares before any weights load
(common/models/pairing.py). The special tokens are those Hugging Face's `all_special_tokens` lists for
the same directory: the named ones (bos, eos, unk, ...) and the additional ones, in that order.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..protocol.fingerprints import fingerprint

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TokenizerFiles:
    """A directory's tokenizer.json, tokenizer_config.json and chat template, read with `tokenizers`."""

    def __init__(self, directory: str | Path) -> None:
        """FileNotFoundError when `directory` holds no tokenizer.json."""
        from tokenizers import Tokenizer

        d = Path(directory)
        if not (d / TOKENIZER_FILE).is_file():
            raise FileNotFoundError(f"no {TOKENIZER_FILE} in {d}")
        self.directory = d
        self.tokenizer = Tokenizer.from_file(str(d / TOKENIZER_FILE))
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

    def get_vocab(self) -> dict[str, int]:
        """Token text -> id, added tokens included (Hugging Face's get_vocab)."""
        return self.tokenizer.get_vocab(with_added_tokens=True)

    @property
    def all_special_tokens(self) -> list[str]:
        """The special tokens (Hugging Face's all_special_tokens)."""
        return list(self.special_tokens)

    @property
    def eos_token_id(self) -> int | None:
        """The end-of-sequence token's id, if the config names one."""
        eos = self.named.get("eos_token")
        return None if eos is None else self.tokenizer.token_to_id(eos)

    def fingerprint(self) -> str:
        """common.models.loading.tokenizer_fingerprint of the Hugging Face tokenizer of this directory."""
        return fingerprint(self.get_vocab(), self.special_tokens)


def _content(value) -> str:
    """A special token's text, whether the config holds it as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""
