"""Training and evaluation sequences: the target's own responses to chat prompts, or a user corpus."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..common.models import LoadedModel
from ..edge.prompt import encode_prompt


@dataclass
class Sample:
    """One sequence; the drafter is trained and scored on predicting ids[start:]."""

    ids: list[int]
    start: int  # index of the first response token (>= 1)


def generate_samples(target: LoadedModel, prompts: list[str], max_new_tokens: int, temperature: float,
                     batch_size: int, seed: int, desc: str = "generating") -> list[Sample]:
    """The target's responses to chat-templated `prompts`, generated in left-padded batches."""
    tok = target.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else target.eos_token_ids[0]
    eos = set(target.eos_token_ids)
    torch.manual_seed(seed)
    samples = []
    encoded = [encode_prompt(tok, p, chat=True) for p in prompts]
    for i in tqdm(range(0, len(encoded), batch_size), desc=desc, unit="batch"):
        batch = encoded[i: i + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(b)) + b for b in batch], device=target.device)
        mask = torch.tensor([[0] * (width - len(b)) + [1] * len(b) for b in batch], device=target.device)
        with torch.inference_mode():
            out = target.model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=pad,
                do_sample=temperature > 0, temperature=temperature if temperature > 0 else None,
                top_p=None, top_k=None)
        for prompt, row in zip(batch, out[:, width:].tolist()):
            response = []
            for t in row:
                response.append(t)
                if t in eos:
                    break
            samples.append(Sample(ids=prompt + response, start=len(prompt)))
    return samples


def corpus_samples(target: LoadedModel, path: Path, max_tokens: int) -> list[Sample]:
    """Samples from a user corpus: .jsonl with {"prompt", "response"} or {"text"}, else one text per line."""
    tok = target.tokenizer
    samples = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            row = json.loads(line)
            if "prompt" in row:
                prompt = encode_prompt(tok, row["prompt"], chat=True)
                response = tok(row["response"], add_special_tokens=False)["input_ids"]
                samples.append(Sample(prompt + response[:max_tokens], len(prompt)))
                continue
            line = row["text"]
        ids = tok(line, add_special_tokens=False)["input_ids"][: max_tokens + 1]
        if len(ids) >= 2:
            samples.append(Sample(ids, 1))
    if not samples:
        raise ValueError(f"corpus {path} holds no usable samples")
    return samples


def head_ids_by_frequency(samples: list[Sample], size: int, always: tuple[int, ...], vocab: int) -> torch.Tensor:
    """The `size` ids most frequent in the samples' targets, plus `always` (e.g. EOS); sorted."""
    if size <= 0 or size >= vocab:
        return torch.arange(vocab)
    counts = torch.zeros(vocab, dtype=torch.long)
    for s in samples:
        counts += torch.bincount(torch.tensor(s.ids), minlength=vocab)
    counts[list(always)] = counts.max() + 1
    return torch.topk(counts, size).indices.sort().values
