"""Distil a small drafter from a target: data from the target, forward KL on its distributions."""
from __future__ import annotations

import json
import random
import time
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from ..common.models.compact import Manifest
from ..common.models.manifest import EAGLE_KIND
from ..common.models.embedded import resolve
from ..common.models.loading import LoadedModel, load_model, tokenizer_fingerprint
from .data import (
    Sample,
    corpus_samples,
    generate_with_features,
    head_ids_by_frequency,
    self_instruct_requests,
)
from .eagle import build_head, depth1_agreement, train_head
from .evaluate import Report, eagle_report, evaluate
from .optim import pick, warmup_cosine
from .optim import step as optim_step
from .prompts import heldout_prompts, train_prompts
from .config import DistillConfig
from .student import build_student, own_state, round_to_storage, save_compact

FEATURES = "train-features.safetensors"  # beside train-samples.jsonl: an eagle run's features, reusable with --data


def distill(cfg: DistillConfig) -> dict:
    """Run the whole recipe and return the report that is also written to OUT/report.json."""
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    target = load_model(cfg.target, cfg.device)
    eagle = cfg.kind == EAGLE_KIND
    if not eagle and cfg.layers >= target.model.config.num_hidden_layers:
        raise ValueError(f"--layers {cfg.layers} must be below the target's {target.model.config.num_hidden_layers}")
    # 1. Data: the target's own responses (what the drafter will have to predict), plus any corpus;
    #    for an eagle head also the target's features at every position.
    train, train_feats = training_data(cfg, target, eagle)
    save_samples(train, out / "train-samples.jsonl")
    if eagle:
        save_file({str(i): f for i, f in enumerate(train_feats)}, out / FEATURES)
    heldout, heldout_feats = generate_with_features(target, heldout_prompts(cfg.heldout), cfg.max_new_tokens, 0.0,
                                                    cfg.gen_batch_size, cfg.seed, "target writes held-out data",
                                                    features=eagle)
    head_ids = head_ids_by_frequency(train, cfg.head_size, target.eos_token_ids, target.vocab_size)
    # 2. Train, save, and evaluate exactly what was saved.
    if eagle:
        trained = _train_eagle(cfg, target, train, train_feats, heldout, heldout_feats, head_ids, out)
    else:
        trained = _train_model(cfg, target, train, heldout, head_ids, out)
    report = {"config": asdict(cfg), "train_samples": len(train), "train_tokens": sum(len(s.ids) - s.start for s in train),
              "heldout_samples": len(heldout), **trained}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def training_data(cfg: DistillConfig, target: LoadedModel, features: bool) -> tuple[list[Sample], list[torch.Tensor]]:
    """Samples from --data and from the target answering prompts (templated and self-written), and
    with `features` the target's features at every position of each sample but the last."""
    train: list[Sample] = []
    feats: list[torch.Tensor] = []
    if cfg.data:
        path = Path(cfg.data)
        train = load_samples(path, target, cfg.max_new_tokens)
        if features:
            stored = path.with_name(FEATURES)
            if path.name == "train-samples.jsonl" and stored.is_file():
                with safe_open(stored, framework="pt") as f:
                    feats = [f.get_tensor(str(i)) for i in range(len(f.keys()))]
            if len(feats) != len(train):
                feats = teacher_states(target, train, all_positions=True)
    prompts = self_instruct_requests(target, cfg.self_instruct, cfg.gen_batch_size, cfg.seed) if cfg.self_instruct else []
    prompts += train_prompts(cfg.generate, cfg.seed) if cfg.generate else []
    random.Random(cfg.seed).shuffle(prompts)
    temps = cfg.sampling_temperatures
    for i, temp in enumerate(temps):
        share = prompts[i * len(prompts) // len(temps): (i + 1) * len(prompts) // len(temps)]
        if share:
            samples, states = generate_with_features(target, share, cfg.max_new_tokens, temp, cfg.gen_batch_size,
                                                     cfg.seed, f"target writes training data (T={temp:g})",
                                                     features=features)
            train += samples
            feats += states
    return train, feats


def _train_model(cfg: DistillConfig, target: LoadedModel, train: list[Sample], heldout: list[Sample],
                 head_ids: torch.Tensor, out: Path) -> dict:
    """A small causal LM: the target's first layers, trained on forward KL over the head's rows."""
    dev = target.device
    student = build_student(target.model, cfg.layers, head_ids)
    teacher_hidden = teacher_states(target, train)
    head = student.lm_head.weight.detach()
    # Forward KL(p_target || q_drafter) over the head's rows.
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    sched = warmup_cosine(opt, cfg.steps)
    rng = random.Random(cfg.seed)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else nullcontext()
    curve = [{"step": 0, **_summary(evaluate(student.eval(), head_ids, heldout, dev))}]
    losses = []
    bar = tqdm(range(1, cfg.steps + 1), desc="distilling", unit="step")
    start = time.perf_counter()
    for step in bar:
        student.train()
        chosen = pick(train, cfg.batch_tokens, rng)
        ids, mask, positions, teacher = _batch([train[i] for i in chosen], [teacher_hidden[i] for i in chosen], dev)
        with autocast:
            logits = student(input_ids=ids, attention_mask=mask).logits[positions].float()
        p = torch.softmax(teacher.float() @ head.float().T, dim=-1)
        loss = F.kl_div(F.log_softmax(logits, -1), p, reduction="batchmean")
        optim_step(opt, sched, params, loss)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}", heldout_agree=f"{curve[-1]['agreement']:.3f}")
        if step % cfg.eval_every == 0 or step == cfg.steps:
            curve.append({"step": step, "loss": loss.item(), **_summary(evaluate(student.eval(), head_ids, heldout, dev))})
            bar.set_postfix(loss=f"{loss.item():.3f}", heldout_agree=f"{curve[-1]['agreement']:.3f}")
    train_s = time.perf_counter() - start
    manifest = Manifest(base=cfg.base or str(Path(target.name).resolve()), num_layers=cfg.layers,
                        base_tokenizer_fingerprint=tokenizer_fingerprint(target.tokenizer), store=cfg.store)
    save_compact(own_state(student), head_ids, out, manifest)
    round_to_storage(student, cfg.store)  # the final numbers are those of the saved weights
    final = evaluate(student.eval(), head_ids, heldout, dev)
    return {"train_s": train_s, "own_parameters": sum(v.numel() for v in own_state(student).values()),
            "final": asdict(final), "curve": curve, "losses": losses}


def _train_eagle(cfg: DistillConfig, target: LoadedModel, train: list[Sample], train_feats: list[torch.Tensor],
                 heldout: list[Sample], heldout_feats: list[torch.Tensor], head_ids: torch.Tensor, out: Path) -> dict:
    """An EAGLE head on the target's features; the final numbers replay greedy rounds exactly."""
    init = load_model(resolve(cfg.init, "plain"), "cpu", "float32") if cfg.init else None
    if init is not None and init.head_ids is None:
        raise ValueError(f"--init {cfg.init} is not a compact drafter of this target")
    head = build_head(target, head_ids, init).to(target.device)
    head_ids = head.head_ids
    curve, losses, train_s = train_head(
        head, train, train_feats, cfg.steps, cfg.batch_tokens, cfg.lr, cfg.seed, cfg.unroll,
        lambda h: depth1_agreement(h, heldout, heldout_feats), cfg.eval_every, cfg.feature_loss)
    manifest = Manifest(base=cfg.base or str(Path(target.name).resolve()), num_layers=len(head.body.layers),
                        base_tokenizer_fingerprint=tokenizer_fingerprint(target.tokenizer), store=cfg.store,
                        kind=EAGLE_KIND)
    state = head.state_dict()
    save_compact(state, head_ids, out, manifest)
    round_to_storage(head, cfg.store, state)  # the final numbers are those of the saved weights
    loaded = LoadedModel(name=str(out), model=head.eval(), tokenizer=target.tokenizer, device=head.device,
                         head_ids=head_ids)
    final = eagle_report(loaded, heldout, heldout_feats, target.vocab_size)
    return {"train_s": train_s, "own_parameters": sum(v.numel() for v in state.values()),
            "final": asdict(final), "curve": curve, "losses": losses}


@torch.inference_mode()
def teacher_states(target: LoadedModel, samples: list[Sample], batch_size: int = 16,
                   all_positions: bool = False) -> list[torch.Tensor]:
    """Per sample, the target's final hidden states (fp16) at the positions predicting response tokens,
    or with `all_positions` at every position but the last.

    Right-padded batches: with causal attention, padding after a sequence cannot change it.
    """
    states = []
    for i in tqdm(range(0, len(samples), batch_size), desc="target scores training data", unit="batch"):
        chunk = samples[i: i + batch_size]
        width = max(len(s.ids) for s in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for b, s in enumerate(chunk):
            ids[b, : len(s.ids)] = torch.tensor(s.ids)
            mask[b, : len(s.ids)] = 1
        hidden = target.model.model(input_ids=ids.to(target.device), attention_mask=mask.to(target.device)).last_hidden_state
        states += [hidden[b, 0 if all_positions else s.start - 1: len(s.ids) - 1].to("cpu", torch.float16)
                   for b, s in enumerate(chunk)]
    return states


def load_samples(path: Path, target: LoadedModel, max_tokens: int) -> list[Sample]:
    """Pre-tokenized samples (rows with "ids" and "start") or a text corpus."""
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    first = path.read_text().split("\n", 1)[0]
    if path.suffix == ".jsonl" and '"ids"' in first:
        return [Sample(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
    return corpus_samples(target, path, max_tokens)


def save_samples(samples: list[Sample], path: Path) -> None:
    """Write samples so a later run can reuse them with --data."""
    path.write_text("".join(json.dumps(asdict(s)) + "\n" for s in samples))


def _summary(r: Report) -> dict:
    return {"agreement": r.agreement, "acceptance_g4": r.acceptance.get(4, 0.0),
            "tokens_per_round_g4": r.tokens_per_round.get(4, 0.0)}


def _batch(chosen: list[Sample], states: list[torch.Tensor], device: torch.device):
    """Right-padded ids and mask, the (row, column) positions that predict response tokens, and the
    teacher's hidden states at exactly those positions, in the same order."""
    width = max(len(s.ids) for s in chosen)
    ids = torch.zeros(len(chosen), width, dtype=torch.long)
    mask = torch.zeros(len(chosen), width, dtype=torch.long)
    rows, cols = [], []
    for b, s in enumerate(chosen):
        ids[b, : len(s.ids)] = torch.tensor(s.ids)
        mask[b, : len(s.ids)] = 1
        cols += range(s.start - 1, len(s.ids) - 1)
        rows += [b] * (len(s.ids) - s.start)
    positions = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
    return ids.to(device), mask.to(device), positions, torch.cat(states).to(device)
