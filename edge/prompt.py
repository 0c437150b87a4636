"""Turning user text into the prompt token ids both sides start from: with a Hugging Face tokenizer, or
with an edge's codec (edge/textcodec.py: `edge generate` and `edge serve`, no transformers needed)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

NO_TEMPLATE = "chat prompts need a tokenizer with a chat template; this one has none"


class Codec(Protocol):
    """What an edge encodes prompts with (edge/textcodec.py TextCodec and HFCodec)."""

    chat_template: str | None

    def encode(self, text: str) -> list[int]:
        ...

    def encode_chat(self, messages: list[dict]) -> list[int]:
        ...


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str, chat: bool) -> list[int]:
    """Token ids for `text`; with chat=True, one user message in the chat template plus the
    generation prompt. Raises ValueError for an empty prompt."""
    if chat:
        return encode_messages(tokenizer, [{"role": "user", "content": text}])
    return _checked(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_messages(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """Token ids for a conversation (`role` and `content` per message) in the tokenizer's chat
    template, ending with the prompt for the assistant's reply. Control tokens inside the messages
    are encoded as plain text, so a user cannot close their own turn and forge another one.
    Raises ValueError without a chat template or for an empty prompt."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(NO_TEMPLATE)
    encoded = tokenizer.apply_chat_template([dict(m) for m in messages], add_generation_prompt=True,
                                            sanitize_control_tokens=True)
    return _checked(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def codec_text(codec: Codec, text: str) -> list[int]:
    """`encode_prompt(..., chat=False)` with an edge's codec: the same ids."""
    return _checked(codec.encode(text))


def codec_messages(codec: Codec, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """`encode_messages` with an edge's codec: the same ids, control tokens in messages as plain text.
    Raises ValueError without a chat template or for an empty prompt."""
    if not codec.chat_template:
        raise ValueError(NO_TEMPLATE)
    return _checked(codec.encode_chat([dict(m) for m in messages]))


def _checked(ids) -> list[int]:
    if not ids:
        raise ValueError("the prompt is empty after tokenization")
    return [int(t) for t in ids]
