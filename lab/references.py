"""What every greedy row of an experiment is judged against: the served engine decoding each prompt
alone (baselines.engine_greedy), computed once and kept in OUT/references.json. A hybrid run is exact
only against the arithmetic of the engine that verified it, so the reference runs on that engine,
with the cloud's own settings (docs/engine.md)."""
from __future__ import annotations

import json
from pathlib import Path

from tqdm import tqdm

from ..cloud.config import ServeConfig
from ..cloud.core.verifier import Verifier, VerifierLimits
from ..cloud.engine.factory import load_engine
from .baselines import engine_greedy


def served_verifier(target: str, cloud: dict) -> Verifier:
    """A verifier on the engine the experiment's cloud serves with (one thread)."""
    # One session at a time: one stream (a llama.cpp cache is a function of its tokens, however many)
    replica = ServeConfig.of(**cloud).replica
    limits = VerifierLimits(max_context=8192, max_sessions=1, kv_streams=1, kv_cache_tokens=8192)
    loaded, engine = load_engine(target, replica.engine, replica.device, replica.dtype, 1, limits)
    return Verifier(loaded, limits, engine)


def load_references(file: Path, prompts: list[list[int]], max_new_tokens: int,
                    verifier: Verifier) -> dict[int, list[int]]:
    """Each prompt's reference tokens: from `file` when it holds them for these prompts, length and
    weights, else decoded now and written there."""
    weights = verifier.info.dtype  # names the arithmetic: Q4_1, float32, ...
    stored = json.loads(file.read_text()) if file.is_file() else {}
    if (stored.get("max_new_tokens"), stored.get("prompts"), stored.get("weights")) == (max_new_tokens, prompts, weights):
        return {int(k): v for k, v in stored["tokens"].items()}
    references = {i: engine_greedy(verifier, prompt, max_new_tokens)
                  for i, prompt in enumerate(tqdm(prompts, desc="reference (served engine alone, greedy)", unit="prompt"))}
    file.write_text(json.dumps({"max_new_tokens": max_new_tokens, "prompts": prompts, "weights": weights,
                                "tokens": references}) + "\n")
    return references
