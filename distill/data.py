"""Training and evaluation sequences: the target's own responses to chat prompts, or a user corpus."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..common.models.loading import LoadedModel
from ..edge.prompt import encode_prompt
from .prompts import clean_request, self_instruct_meta_prompts


@dataclass
class Sample:
    """One sequence; the drafter is trained and scored on predicting ids[start:]."""

    ids: list[int]
    start: int  # index of the first response token (>= 1)


def generate_samples(target: LoadedModel, prompts: list[str], max_new_tokens: int, temperature: float,
                     batch_size: int, seed: int, desc: str = "generating") -> list[Sample]:
    """The target's responses to chat-templated `prompts`, generated in left-padded batches."""
    return generate_with_features(target, prompts, max_new_tokens, temperature, batch_size, seed, desc,
                                  features=False)[0]


def generate_with_features(target: LoadedModel, prompts: list[str], max_new_tokens: int, temperature: float,
                           batch_size: int, seed: int, desc: str = "generating", features: bool = True,
                           ) -> tuple[list[Sample], list[torch.Tensor]]:
    """Responses as `generate_samples`, plus per sample the target's final hidden states at every
    position but the last (`[len(ids) - 1, H]`, fp16), taken from the generating passes themselves:
    they equal a teacher-forced pass up to rounding, and cost nothing extra."""
    tok = target.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else target.eos_token_ids[0]
    eos = set(target.eos_token_ids)
    torch.manual_seed(seed)
    samples, states = [], []
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
                top_p=None, top_k=None, output_hidden_states=features, return_dict_in_generate=True)
        if features:
            # hidden_states[step][-1]: the final (normed) layer for the tokens fed at that step.
            hidden = torch.cat([step[-1] for step in out.hidden_states], dim=1)
        for b, (prompt, row) in enumerate(zip(batch, out.sequences[:, width:].tolist())):
            response = []
            for t in row:
                response.append(t)
                if t in eos:
                    break
            sample = Sample(ids=prompt + response, start=len(prompt))
            samples.append(sample)
            if features:
                first = width - len(prompt)
                states.append(hidden[b, first: first + len(sample.ids) - 1].to("cpu", torch.float16).clone())
    return samples, states


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


def self_instruct_requests(target: LoadedModel, count: int, batch_size: int, seed: int) -> list[str]:
    """Up to `count` distinct user requests written by the target itself (sampled at temperature 1)."""
    metas = self_instruct_meta_prompts(count, seed)
    written = generate_samples(target, metas, 48, 1.0, batch_size, seed, "target writes requests")
    texts = (clean_request(target.tokenizer.decode(s.ids[s.start:], skip_special_tokens=True)) for s in written)
    return list(dict.fromkeys(t for t in texts if t))
