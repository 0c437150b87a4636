"""Turning user text into the prompt token ids both sides start from."""
from __future__ import annotations

from transformers import PreTrainedTokenizerBase


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str, chat: bool) -> list[int]:
    """Token ids for `text`; with chat=True, one user message in the chat template plus the
    generation prompt. Raises ValueError for an empty prompt."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("--chat needs a tokenizer with a chat template; this one has none")
        encoded = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        ids = list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
    else:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError("the prompt is empty after tokenization")
    return [int(t) for t in ids]
