"""Text to token ids and back without torch or transformers, so an edge can start decoding at once.

Importing torch and transformers and loading a drafter takes seconds on a small CPU; encoding a prompt
and decoding tokens needs only the `tokenizers` library and, for chat prompts, the jinja chat template
stored next to it. `TextCodec` does what the Hugging Face fast tokenizer of the same directory does
(tests/test_edge_text.py holds the two to the same output), so the edge can open a cloud stream while
the drafter still loads (edge/startup.py), and `edge serve --cloud-only` serves with no drafter at all.

Chat prompts come from untrusted users (`edge serve`): a control token typed inside a message (say
`<|im_end|>`) must be encoded as the plain text it is, or a user could close their own turn and forge
another. So messages are encoded as Hugging Face's `apply_chat_template(..., sanitize_control_tokens=True)`
encodes them, to the same ids: control tokens inside messages are wrapped in private-use markers before
the template is rendered, and the rendered text is encoded piece by piece, the marked tokens as text.
"""
from __future__ import annotations

import json
import re
from datetime import datetime
from functools import cached_property
from pathlib import Path

from ..common.models.vocabulary import TOKENIZER_FILE, TokenizerFiles
from ..common.protocol.fingerprints import fingerprint
# The clean-up Hugging Face applies after decoding when a tokenizer asks for it (clean_up_tokenization_spaces).
_CLEANUPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
             (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))
# Around a control token a user wrote (private-use characters, as Hugging Face marks them: the same ids).
MARK_START, MARK_END = "\U000f0000", "\U000f0001"


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
        self._chat_control = files.config.get("chat_control_tokens")  # the template's own list, if it has one
        self._eos = files.eos_token_id
        self._compiled = None

    @property
    def vocab_size(self) -> int:
        """Token ids the tokenizer knows, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The end-of-sequence token the tokenizer's config names (none if it names none)."""
        return () if self._eos is None else (self._eos,)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no special tokens added."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The chat template applied to `messages` (role/content dicts) with the assistant's prompt, then
        encoded; control tokens inside the messages are encoded as plain text (the module's docstring).
        ValueError without a chat template, or for a control token that plain text cannot avoid."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        control = self._control_pattern
        marked = [{k: _marked(v, control) for k, v in m.items() if v is not None} for m in messages]
        return self._encode_marked(self.render_chat(marked))

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

    # ---- chat prompts from untrusted text -------------------------------------------------------

    @cached_property
    def _control_pattern(self) -> re.Pattern:
        """Any control token: a special added token, or one the template writes itself (the config's
        chat_control_tokens when it lists them, else an added token found among the template's literal
        text, whitespace tokens aside), longest first."""
        added = self._tok.get_added_tokens_decoder().values()
        if isinstance(self._chat_control, list):
            listed = set(self._chat_control)
            tokens = [t.content for t in added if t.special or t.content in listed]
        else:
            literal = _template_literals(self.chat_template or "")
            tokens = [t.content for t in added if t.special or (t.content in literal and not t.content.isspace())]
        return _alternatives(tokens)

    @cached_property
    def _marks(self) -> re.Pattern:
        """A marked added token (its text in group 1), or a lone marker."""
        tokens = _alternatives(t.content for t in self._tok.get_added_tokens_decoder().values()).pattern
        return re.compile(f"{MARK_START}({tokens}){MARK_END}|[{MARK_START}{MARK_END}]")

    @cached_property
    def _as_text(self):
        """The same tokenizer, reading special tokens as plain text (its own copy: threads encode at once)."""
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(self._tok.to_str())
        tok.encode_special_tokens = True
        return tok

    def _encode_marked(self, chat: str) -> list[int]:
        """A rendered chat's ids: the marked tokens as plain text, the rest (the template's own control
        tokens included) as usual. A lone marker (a template's string method split a marked token)
        is dropped, and still separates the text on its two sides."""
        as_text = self._as_text
        pieces = self._marks.split(chat)  # [text, marked token or None, text, ...]
        newline = self.encode("\n")
        ids = self.encode(pieces[0])
        for i, piece in enumerate(pieces[1:], start=1):
            if not piece:
                continue
            plain = i % 2 == 1
            encode = (lambda t: list(as_text.encode(t, add_special_tokens=False).ids)) if plain else self.encode
            # After a newline, so that a SentencePiece tokenizer adds no prefix space; the newline removed.
            piece_ids = encode("\n" + piece)
            piece_ids = piece_ids[len(newline):] if piece_ids[:len(newline)] == newline else encode(piece)
            if plain and self._tok.token_to_id(piece) in piece_ids:
                raise ValueError(f"cannot encode {piece!r} as plain text: this tokenizer makes it from plain text")
            ids += piece_ids
        return ids


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


def _marked(value, control: re.Pattern):
    """`value` (a string, or lists and dicts of them) with every control token wrapped in the markers;
    markers already there are dropped first, so a user cannot forge a marked token."""
    if isinstance(value, str):
        value = value.replace(MARK_START, "").replace(MARK_END, "")
        return control.sub(lambda m: f"{MARK_START}{m.group(0)}{MARK_END}", value)
    if isinstance(value, dict):
        return {k: _marked(v, control) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_marked(v, control) for v in value]
    return value


def _alternatives(tokens) -> re.Pattern:
    """A pattern matching any of `tokens`, the longest first (a token before the tokens inside it);
    one that never matches for none."""
    ordered = sorted(set(tokens), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, ordered)) or "(?!)")


def _template_literals(template: str) -> str:
    """A chat template's literal text and string constants, joined by NULs (a search cannot match
    across two of them)."""
    from jinja2 import nodes

    ast = _compile(template).environment.parse(template)
    literals = {n.data for n in ast.find_all(nodes.TemplateData)}
    literals |= {n.value for n in ast.find_all(nodes.Const) if isinstance(n.value, str)}
    return "\0".join(literals)


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
