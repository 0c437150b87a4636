"""The tokenizer fingerprint both sides compare, computed from plain data (no torch, no transformers)."""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable


def fingerprint(vocab: dict[str, int], special_tokens: Iterable[str]) -> str:
    """sha256 over the vocabulary and the special tokens: equal iff both sides tokenize alike."""
    payload = {"vocab": sorted(vocab.items(), key=lambda kv: kv[1]), "special": sorted(special_tokens)}
    return hashlib.sha256(json.dumps(payload, ensure_ascii=False).encode()).hexdigest()[:32]
