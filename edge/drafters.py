"""Building a generation's drafter: prompt lookup, a small LM (on torch or llama.cpp), or an EAGLE
head over a fallback.

Apart from the drafters themselves (edge/drafter.py, edge/eagle.py) so that neither imports the other
back: the EAGLE drafter builds on the model drafter, and this factory knows both. llama.cpp is imported
only when a drafter runs on it (`LoadedModel.llama`, set by load_model's engine choice).
"""
from __future__ import annotations

from ..common.models.loading import LoadedModel
from .drafter import ModelDrafter, NgramDrafter
from .eagle import EagleDrafter, FeatureLog
from .proposal import DraftSettings, Drafter, DrafterKind


def make_drafter(kind: DrafterKind, loaded: LoadedModel | None, settings: DraftSettings,
                 fallback: LoadedModel | None = None) -> Drafter:
    """The drafter of one generation (kind: model or ngram; ngram needs no model). An eagle head
    gives an EagleDrafter, whose `log` takes the verifier's features; `fallback` (else n-gram) drafts
    while it has none. A drafter LM loaded for llama.cpp gets a fresh llama.cpp context of its own, of
    the target's max_context tokens."""
    if kind is DrafterKind.NGRAM:
        return NgramDrafter(settings.sampling, max_ngram=settings.drafting.ngram_max, stop_ids=settings.stop_ids)
    if loaded is None:
        raise ValueError("a model drafter needs a model")
    if loaded.is_eagle:
        plain = make_drafter(DrafterKind.NGRAM if fallback is None else DrafterKind.MODEL, fallback, settings)
        return EagleDrafter(loaded, settings, FeatureLog(), plain)
    if loaded.llama is not None:
        from .llamacpp_lm import LlamaCppLM

        lm = LlamaCppLM.open(loaded.llama, loaded.head_ids, settings.vocab_size, settings.max_context)
        return ModelDrafter(loaded, settings, lm)
    return ModelDrafter(loaded, settings)
