"""Training an EAGLE head (common/models/eagle.py) on the target's own features (`distill --kind eagle`).

For a sample t_0..t_{L-1} with target features f_0..f_{L-2}, the head reads (f_j, t_{j+1}) at
position j+1 and is trained to match the target's distribution of t_{j+2} over the head's rows
(forward KL) plus, as EAGLE-1 does, `feature_loss` × a smooth-L1 regression of the next feature
f_{j+1} (EAGLE-3 drops it; so does the warm-started recipe, where it pulled the plain drafter's
outputs away from what they predict well). Input features get a little noise, and with `unroll` 2 the head also learns from its own
predicted features as inputs — what it meets from the second draft of a block on.
"""
from __future__ import annotations

import random
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..common.models.eagle import EagleHead
from ..common.models.loading import LoadedModel
from .data import Sample
from .optim import pick, warmup_cosine
from .optim import step as step_

NOISE = 0.05  # uniform noise on true input features, relative to their per-dimension RMS


def build_head(target: LoadedModel, head_ids: torch.Tensor, init: LoadedModel | None = None) -> EagleHead:
    """A head for `target`. From scratch (EAGLE's recipe): one decoder layer started as the target's last
    layer, its norm as the target's final norm, fc at random. From `init`, a plain compact drafter
    (a warm start, for when there is too little data or compute to train a head from scratch): its
    layers, norm and head rows, and fc = [0 | I], so the head starts out predicting exactly what the
    plain drafter does and learns to use the features through fc's feature half."""
    embed = target.model.get_input_embeddings().weight.detach().to("cpu", torch.float32)
    if init is not None:
        head_ids = init.head_ids.cpu()
    rows = target.model.get_output_embeddings().weight.detach().to("cpu", torch.float32)[head_ids]
    source = init.model.model if init is not None else None
    layers = source.layers if source is not None else target.model.model.layers[-1:]
    head = EagleHead(target.model.config, embed, rows.clone(), head_ids, num_layers=len(layers))
    for mine, theirs in zip(head.body.layers, layers):
        mine.load_state_dict(theirs.state_dict())
    head.body.norm.load_state_dict((source or target.model.model).norm.state_dict())
    if init is not None:
        hidden = head.hidden_size
        with torch.no_grad():
            head.fc.weight.copy_(torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], dim=1))
            head.fc.bias.zero_()
    return head.float()


def batch(samples: list[Sample], feats: list[torch.Tensor]):
    """Right-padded inputs: features [B, T, H] (f_j), tokens [B, T] (t_{j+1}), target features
    [B, T, H] (f_{j+1}), positions [B, T], attention mask [B, T] and the loss mask [B, T]
    (positions predicting a response token)."""
    width = max(len(s.ids) - 2 for s in samples)
    dim = feats[0].shape[1]
    f_in = torch.zeros(len(samples), width, dim)
    f_out = torch.zeros(len(samples), width, dim)
    tokens = torch.zeros(len(samples), width, dtype=torch.long)
    attend = torch.zeros(len(samples), width, dtype=torch.long)
    loss = torch.zeros(len(samples), width, dtype=torch.bool)
    for b, (s, f) in enumerate(zip(samples, feats)):
        n = len(s.ids) - 2
        f = f.float()
        f_in[b, :n], f_out[b, :n] = f[:n], f[1: n + 1]
        tokens[b, :n] = torch.tensor(s.ids[1: n + 1])
        attend[b, :n] = 1
        loss[b, max(0, s.start - 2): n] = True
    positions = torch.arange(1, width + 1)[None].expand(len(samples), width)
    return f_in, tokens, f_out, positions, attend, loss


def losses(head: EagleHead, f_in, tokens, f_out, positions, attend, mask, unroll: int, noise: torch.Tensor | None,
           feature_loss: float = 1.0):
    """(total loss, depth-1 agreement) of one batch: forward KL to the target's next-token distribution
    plus `feature_loss` × smooth-L1 regression of the next feature; with unroll > 1, later passes feed
    the head its own predictions of the previous feature."""
    target_logp = torch.log_softmax(head.logits(f_out[mask]), dim=-1)
    total, inputs, agree = 0.0, f_in, 0.0
    for depth in range(unroll):
        x = inputs + (torch.rand_like(inputs) * 2 - 1) * noise if noise is not None and depth == 0 else inputs
        pred = head(x, tokens, positions, attention_mask=attend)
        logq = torch.log_softmax(head.logits(pred[mask]), dim=-1)
        kl = F.kl_div(logq, target_logp, log_target=True, reduction="batchmean")
        if feature_loss:
            kl = kl + feature_loss * F.smooth_l1_loss(pred[mask], f_out[mask])
        total = total + kl / (depth + 1)
        if depth == 0:
            agree = (logq.argmax(-1) == target_logp.argmax(-1)).float().mean().item()
        inputs = torch.cat([f_in[:, :1], pred[:, :-1]], dim=1)  # the feature before t_{j+1}, as predicted
    return total, agree


def train_head(head: EagleHead, train: list[Sample], feats: list[torch.Tensor], steps: int, batch_tokens: int,
               lr: float, seed: int, unroll: int, evaluate: Callable[[EagleHead], float], eval_every: int,
               feature_loss: float = 1.0) -> tuple[list[dict], list[float], float]:
    """Train in place; returns the curve of `evaluate` (held-out depth-1 agreement), losses, seconds."""
    rng = random.Random(seed)
    rms = torch.cat([f[:64].float() for f in feats[:256]]).pow(2).mean(0).sqrt()
    params = [p for p in head.parameters() if p.requires_grad]
    # Features are ~15x larger than embeddings (SmolLM2: RMS 1.9 vs 0.14), and Adam moves every weight by
    # about lr a step whatever its gradient, so fc's feature half would swamp the embedding signal the
    # decoder layers were trained on within a few steps. Scaling fc's rate by the ratio keeps a step's
    # effect on fc's output alike from both halves.
    ratio = (head.embed.pow(2).mean().sqrt() / rms.pow(2).mean().sqrt()).item()
    fc = [head.fc.weight, head.fc.bias]
    groups = [{"params": [p for p in params if all(p is not q for q in fc)]}, {"params": fc, "lr": lr * ratio}]
    opt = torch.optim.AdamW(groups, lr=lr, weight_decay=0.0)
    sched = warmup_cosine(opt, steps)
    curve = [{"step": 0, "agreement": evaluate(head)}]
    history = []
    start = time.perf_counter()
    bar = tqdm(range(1, steps + 1), desc="training eagle head", unit="step")
    for step in bar:
        head.train()
        chosen = pick(train, batch_tokens, rng)
        f_in, tokens, f_out, positions, attend, mask = batch([train[i] for i in chosen], [feats[i] for i in chosen])
        loss, agree = losses(head, f_in, tokens, f_out, positions, attend, mask, unroll, NOISE * rms, feature_loss)
        step_(opt, sched, params, loss)
        history.append(loss.item())
        if step % eval_every == 0 or step == steps:
            curve.append({"step": step, "loss": loss.item(), "agreement": evaluate(head)})
        bar.set_postfix(loss=f"{loss.item():.3f}", train_agree=f"{agree:.3f}", heldout=f"{curve[-1]['agreement']:.3f}")
    return curve, history, time.perf_counter() - start


@torch.inference_mode()
def depth1_agreement(head: EagleHead, samples: list[Sample], feats: list[torch.Tensor]) -> float:
    """How often the head's argmax, fed true features, is the target's token (response positions)."""
    head.eval()
    hits = total = 0
    for i in range(0, len(samples), 16):
        f_in, tokens, f_out, positions, attend, mask = batch(samples[i:i + 16], feats[i:i + 16])
        pred = head(f_in, tokens, positions, attention_mask=attend)
        hits += (head.logits(pred[mask]).argmax(-1) == head.logits(f_out[mask]).argmax(-1)).sum().item()
        total += int(mask.sum())
    return hits / max(total, 1)
