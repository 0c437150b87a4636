"""Whether a drafter fits a target, from their files alone: no weights are loaded.

A pair runs only if both sides tokenize alike: the verifier accepts a drafter's tokens by id, and the
edge and the cloud compare a fingerprint of the vocabulary and the special tokens before any session
(common/protocol/fingerprints.py). A fingerprint says only *that* they differ; `check_pair` says
where, in one line (`PairMismatch`), before anything slow starts. It also compares what does not stop
a pair but changes what it does: the chat templates (the edge renders chat prompts with the
drafter's), and the context lengths (the edge sizes the drafter's context to the target's
max_context, whatever the drafter was trained for).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..config import ConfigError
from .vocabulary import TOKENIZER_FILE, TokenizerFiles


class PairMismatch(ConfigError):
    """The drafter cannot draft for this target: the message names the first difference."""


@dataclass(frozen=True)
class ModelFiles:
    """What a model option's files say without loading weights."""

    spec: str  # the option as resolved (a path, or a hub id)
    tokenizer: TokenizerFiles
    context_length: int  # what the model was trained for (0: its files do not say)
    parameters: int  # values in its weights (0: not known without reading them)
    gguf: Path | None = None  # the GGUF file, for a GGUF model


def describe(spec: str) -> ModelFiles:
    """The files of a .gguf file, a model directory, a compact drafter (its target's tokenizer) or a
    cached hub id; FileNotFoundError or ConfigError in one line when they cannot be read."""
    from .gguf import find_gguf
    from .gguf_file import read_header, tokenizer_files
    from .sources import SourceKind, classify_model
    from .manifest import MANIFEST, Manifest, resolve_base

    path = Path(spec).expanduser()
    kind = classify_model(spec)
    if kind is SourceKind.GGUF:
        header = read_header(path, strings=frozenset())
        return ModelFiles(spec, TokenizerFiles(tokenizer_files(path)), header.context_length, header.parameters, path)
    if kind is SourceKind.COMPACT:
        base = resolve_base(path, Manifest(**json.loads((path / MANIFEST).read_text())))
        inner = describe(str(base))
        return ModelFiles(spec, inner.tokenizer, inner.context_length, 0)
    if kind is SourceKind.HUB_ID:
        from huggingface_hub import try_to_load_from_cache

        path = Path(try_to_load_from_cache(spec, "config.json")).parent
    config = json.loads((path / "config.json").read_text())
    gguf = find_gguf(path)
    if not (path / TOKENIZER_FILE).is_file():
        raise FileNotFoundError(f"{spec} has no {TOKENIZER_FILE}: its vocabulary cannot be compared")
    parameters = read_header(gguf, strings=frozenset()).parameters if gguf is not None else 0
    return ModelFiles(spec, TokenizerFiles(path), int(config.get("max_position_embeddings") or 0), parameters, gguf)


@dataclass(frozen=True)
class PairFit:
    """What `check_pair` found besides a mismatch: notes on what the pair will do."""

    vocab_size: int  # tokens both share
    special_tokens: tuple[str, ...]
    same_chat_template: bool
    context: int  # tokens a session may hold: the target's max_context
    notes: tuple[str, ...]  # one line each: template and context differences


def check_pair(target: ModelFiles, drafter: ModelFiles, max_context: int) -> PairFit:
    """PairMismatch naming the first difference when the vocabularies or the special tokens differ;
    otherwise what else differs. max_context: the target's limit on a session's tokens as served."""
    vocab = _by_id(target.tokenizer.get_vocab())
    other = _by_id(drafter.tokenizer.get_vocab())
    if vocab != other:
        raise PairMismatch(f"the drafter cannot draft for this target: {_first_difference(vocab, other)}")
    specials, others = set(target.tokenizer.special_tokens), set(drafter.tokenizer.special_tokens)
    if specials != others:
        only_target, only_drafter = sorted(specials - others), sorted(others - specials)
        side = (f"the target's special token {only_target[0]!r} is an ordinary token to the drafter" if only_target
                else f"the drafter's special token {only_drafter[0]!r} is an ordinary token to the target")
        raise PairMismatch(f"the drafter cannot draft for this target: the vocabularies agree but {side}")
    notes = []
    same_template = target.tokenizer.chat_template == drafter.tokenizer.chat_template
    if not same_template:
        which = ("the drafter has none" if drafter.tokenizer.chat_template is None else
                 "the target has none" if target.tokenizer.chat_template is None else "they differ")
        notes.append(f"chat templates: {which}; the edge renders chat prompts with the drafter's, so the target "
                     "sees that format")
    if target.context_length and max_context > target.context_length:
        notes.append(f"context: max_context {max_context} exceeds the {target.context_length} tokens the target "
                     "was trained for")
    if drafter.context_length and drafter.context_length < max_context:
        notes.append(f"context: the drafter was trained for {drafter.context_length} tokens, the target serves up to "
                     f"{max_context}; the edge gives the drafter a context of {max_context} (llama.cpp), and "
                     f"past {drafter.context_length} its guesses, and the acceptance, may fall")
    return PairFit(len(vocab), tuple(sorted(specials)), same_template, max_context, tuple(notes))


def _by_id(vocab: dict[str, int]) -> list[str | None]:
    """A vocabulary as a list indexed by id (None for an id no token has)."""
    tokens: list[str | None] = [None] * (max(vocab.values(), default=-1) + 1)
    for token, i in vocab.items():
        tokens[i] = token
    return tokens


def _first_difference(target: list[str | None], drafter: list[str | None]) -> str:
    """The first id where two vocabularies part, in words."""
    for i, (a, b) in enumerate(zip(target, drafter)):
        if a != b:
            sizes = "" if len(target) == len(drafter) else f" (and their sizes differ: {len(target)} and {len(drafter)} tokens)"
            return f"token id {i} is {a!r} to the target and {b!r} to the drafter{sizes}"
    longer, shorter = ("target", "drafter") if len(target) > len(drafter) else ("drafter", "target")
    return (f"the {longer}'s vocabulary has {max(len(target), len(drafter))} tokens, the {shorter}'s "
            f"{min(len(target), len(drafter))}: id {min(len(target), len(drafter))} onwards exists for one only")
