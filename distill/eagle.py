"""Training an EAGLE head (common/eagle.py) on the target's own features (`distill --kind eagle`).

For a sample t_0..t_{L-1} with target features f_0..f_{L-2}, the head reads (f_j, t_{j+1}) at
position j+1 and is trained, as EAGLE is, on two things at once: regressing the next feature
f_{j+1} (smooth L1) and matching the target's distribution of t_{j+2} over the head's rows (forward
KL). Input features get a little noise, and with `unroll` 2 the head also learns from its own
predicted features as inputs — what it meets from the second draft of a block on.
"""
from __future__ import annotations

import math
import random
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..common.eagle import EagleHead
from ..common.models import LoadedModel
from .data import Sample

REG_WEIGHT, KL_WEIGHT = 1.0, 0.5  # feature regression vs. the distribution of the next token
NOISE = 0.05  # uniform noise on true input features, relative to their per-dimension RMS


def build_head(target: LoadedModel, head_ids: torch.Tensor) -> EagleHead:
    """A head for `target`: its decoder layer starts as the target's last layer, its norm as the
    target's final norm; fc starts at random."""
    embed = target.model.get_input_embeddings().weight.detach().to("cpu", torch.float32)
    rows = target.model.get_output_embeddings().weight.detach().to("cpu", torch.float32)[head_ids]
    head = EagleHead(target.model.config, embed, rows.clone(), head_ids)
    head.body.layers[0].load_state_dict(target.model.model.layers[-1].state_dict())
    head.body.norm.load_state_dict(target.model.model.norm.state_dict())
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


def losses(head: EagleHead, f_in, tokens, f_out, positions, attend, mask, unroll: int, noise: torch.Tensor | None):
    """(total loss, depth-1 agreement) of one batch; with unroll > 1, later passes feed the head its
    own predictions of the previous feature."""
    target_logp = torch.log_softmax(head.logits(f_out[mask]), dim=-1)
    total, inputs, agree = 0.0, f_in, 0.0
    for depth in range(unroll):
        x = inputs + (torch.rand_like(inputs) * 2 - 1) * noise if noise is not None and depth == 0 else inputs
        pred = head(x, tokens, positions, attention_mask=attend)
        logq = torch.log_softmax(head.logits(pred[mask]), dim=-1)
        reg = F.smooth_l1_loss(pred[mask], f_out[mask])
        kl = F.kl_div(logq, target_logp, log_target=True, reduction="batchmean")
        total = total + (REG_WEIGHT * reg + KL_WEIGHT * kl) / (depth + 1)
        if depth == 0:
            agree = (logq.argmax(-1) == target_logp.argmax(-1)).float().mean().item()
        inputs = torch.cat([f_in[:, :1], pred[:, :-1]], dim=1)  # the feature before t_{j+1}, as predicted
    return total, agree


def train_head(head: EagleHead, train: list[Sample], feats: list[torch.Tensor], steps: int, batch_tokens: int,
               lr: float, seed: int, unroll: int, evaluate: Callable[[EagleHead], float], eval_every: int,
               ) -> tuple[list[dict], list[float], float]:
    """Train in place; returns the curve of `evaluate` (held-out depth-1 agreement), losses, seconds."""
    rng = random.Random(seed)
    rms = torch.cat([f[:64].float() for f in feats[:256]]).pow(2).mean(0).sqrt()
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / steps))))
    curve = [{"step": 0, "agreement": evaluate(head)}]
    history = []
    start = time.perf_counter()
    bar = tqdm(range(1, steps + 1), desc="training eagle head", unit="step")
    for step in bar:
        head.train()
        chosen, used = [], 0
        while used < batch_tokens:
            chosen.append(rng.randrange(len(train)))
            used += len(train[chosen[-1]].ids)
        f_in, tokens, f_out, positions, attend, mask = batch([train[i] for i in chosen], [feats[i] for i in chosen])
        loss, agree = losses(head, f_in, tokens, f_out, positions, attend, mask, unroll, NOISE * rms)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
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
