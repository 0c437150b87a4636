"""Text to token ids and back without torch or transformers, so an edge can start decoding at once.

Importing torch and transformers and loading a drafter takes seconds on a small CPU; encoding a prompt
and decoding tokens needs only the `tokenizers` library and, for chat prompts, the jinja chat template
stored next to it. `TextCodec` does what the Hugging Face fast tokenizer of the same directory does
(tests/test_textcodec.py holds the two to the same output), so the edge can open a cloud stream while
the drafter still loads (edge/startup.py).
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from ..common.models.vocabulary import TOKENIZER_FILE, TokenizerFiles
from ..common.protocol.fingerprints import fingerprint
# The clean-up Hugging Face applies after decoding when a tokenizer asks for it (clean_up_tokenization_spaces).
_CLEANUPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
             (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


class TextCodec:
    """A tokenizer directory's encode, decode and chat template."""

    def __init__(self, directory: str | Path) -> None:
        """FileNotFoundError when `directory` holds no tokenizer.json."""
        files = TokenizerFiles(directory)
        self.directory = files.directory
        self._tok = files.tokenizer
        self.chat_template = files.chat_template
        self._cleanup = bool(files.config.get("clean_up_tokenization_spaces", False))
        self._special = files.named
        self.special_tokens = files.special_tokens
        self._compiled = None

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no special tokens added."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The chat template applied to `messages` (role/content dicts) with the assistant's prompt, then encoded."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        return self.encode(self.render_chat(messages))

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat template's text for `messages`, rendered the way Hugging Face renders it."""
        if self._compiled is None:
            self._compiled = _compile(self.chat_template or "")
        return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **self._special)

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`, special tokens skipped."""
        text = self._tok.decode(list(ids), skip_special_tokens=True)
        if self._cleanup:
            for before, after in _CLEANUPS:
                text = text.replace(before, after)
        return text

    def fingerprint(self) -> str:
        """The same fingerprint as common.models.tokenizer_fingerprint of the Hugging Face tokenizer."""
        return fingerprint(self._tok.get_vocab(with_added_tokens=True), self.special_tokens)


class HFCodec:
    """A loaded Hugging Face tokenizer behind the same interface (drafters without a tokenizer.json)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.chat_template = getattr(tokenizer, "chat_template", None)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no special tokens added."""
        return [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The chat template applied to `messages` (with the assistant's prompt), then encoded, as the
        server encodes them."""
        from .prompt import encode_messages  # transformers: already loaded with this tokenizer

        return encode_messages(self.tokenizer, messages)

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`, special tokens skipped."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def fingerprint(self) -> str:
        """common.models.tokenizer_fingerprint of the tokenizer."""
        return fingerprint(self.tokenizer.get_vocab(), self.tokenizer.all_special_tokens)


def _compile(template: str):
    """A sandboxed jinja template with the environment Hugging Face gives chat templates."""
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)
    return env.from_string(template)


def tokenizer_dir(spec: str | Path) -> Path | None:
    """The directory whose tokenizer a drafter spec uses (a compact drafter's is its target's; a .gguf
    file's, the files made from its metadata: common/models/gguf_file.py), or None when it is not a
    local directory with a tokenizer.json (a hub id). ConfigError for a .gguf carrying no vocabulary."""
    from ..common.models.gguf_file import tokenizer_files
    from ..common.models.manifest import MANIFEST, Manifest, resolve_base

    path = Path(spec).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return tokenizer_files(path)
    if not path.is_dir():
        return None
    if (path / MANIFEST).is_file():
        path = resolve_base(path, Manifest(**json.loads((path / MANIFEST).read_text())))
    return path if (path / TOKENIZER_FILE).is_file() else None
