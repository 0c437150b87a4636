"""Turning user text into the prompt token ids both sides start from."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from transformers import PreTrainedTokenizerBase


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
        raise ValueError("chat prompts need a tokenizer with a chat template; this one has none")
    encoded = tokenizer.apply_chat_template([dict(m) for m in messages], add_generation_prompt=True,
                                            sanitize_control_tokens=True)
    return _checked(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def _checked(ids) -> list[int]:
    if not ids:
        raise ValueError("the prompt is empty after tokenization")
    return [int(t) for t in ids]
