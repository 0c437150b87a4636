"""One forward pass for many sessions, reading and writing their KV pages in place (docs/design.md §3).

The tokens of every session in a step (a verify block, a cloud-only decode step, a prefill chunk)
are packed into one sequence with no padding, so the linear layers, which dominate the cost, run
once over exactly the tokens that are needed. Attention is the only part that must keep sessions
apart: the model's attention layers are routed to `packed_attention`, which attends each session's
queries to that session's own keys. Keys and values are written straight into the session's pages
of the replica's KV pool and gathered from them in one index operation per layer; nothing is
concatenated, padded or split per round. Logits are computed only where a rule needs them; the
target's final hidden states (the features an EAGLE drafter asks for) are handed out only for the
feeds that want them, read from the pass's own output at no extra cost.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from ...common.protocol.tree import feed_depths
from .base import Capabilities, Feed, Scores
from .kvpool import KVPool, PageTable

ATTENTION = "hybridspec_packed"


@dataclass(frozen=True)
class _Row:
    """Where one feed sits in the packed pass, and which keys its queries may see."""

    queries: slice  # its tokens in the packed sequence
    keys: slice  # its cached + new keys in the gathered keys
    mask: torch.Tensor | None  # [n, past + n] causal (or tree) mask unless one token or a fresh chain
    causal: bool  # a fresh chain (no past): plain causal attention


_active = threading.local()  # the rows of the pass this thread is running, if any


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """Attention over each session's own keys; outside an engine pass it is plain SDPA, so the same
    model object still decodes normally (e.g. Hugging Face `generate` as a reference)."""
    rows: list[_Row] | None = getattr(_active, "rows", None)
    if rows is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    out = query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])
    for row in rows:
        attended = F.scaled_dot_product_attention(
            query[:, :, row.queries], key[:, :, row.keys], value[:, :, row.keys], attn_mask=row.mask,
            is_causal=row.causal, scale=scaling, enable_gqa=True)
        out[:, row.queries] = attended.transpose(1, 2)
    return out, None


AttentionInterface.register(ATTENTION, packed_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)


class _PackedPass:
    """Stands in for the model's KV cache during one pass: writes new keys to their pool rows, then
    returns every key the pass's sessions attend to, gathered from the pool."""

    def __init__(self, pool: KVPool, write: torch.Tensor, read: torch.Tensor) -> None:
        self.pool, self.write, self.read = pool, write, read

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.pool.keys[layer_idx], self.pool.values[layer_idx]
        keys.index_copy_(1, self.write, key_states[0])
        values.index_copy_(1, self.write, value_states[0])
        return keys.index_select(1, self.read).unsqueeze(0), values.index_select(1, self.read).unsqueeze(0)


def unsupported_reason(model: PreTrainedModel) -> str | None:
    """Why the engine cannot serve this model (sliding windows, recurrent layers), or None."""
    types = getattr(model.config, "layer_types", None) or ["full_attention"]
    if any(t != "full_attention" for t in types):
        return f"it has {sorted(set(types) - {'full_attention'})} layers; the engine serves full-attention decoders"
    if getattr(model.config, "num_key_value_heads", None) is None:
        return "its config names no num_key_value_heads"
    return None


class TorchEngine:
    """A Hugging Face model bound to a KV pool of `kv_tokens` tokens (implements engine.base.Engine;
    its KV handles are PageTables)."""

    def __init__(self, model: PreTrainedModel, kv_tokens: int) -> None:
        reason = unsupported_reason(model)
        if reason:
            raise ValueError(f"cannot serve {type(model).__name__}: {reason}")
        config = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.model = model
        self.device = model.device
        # The module whose output's last_hidden_state the output head is applied to (LlamaModel for
        # a LlamaForCausalLM): its forward hook hands out features without changing the logits' path.
        self._decoder = model.get_decoder()
        self.pool = KVPool(config.num_hidden_layers, config.num_key_value_heads, head_dim, kv_tokens,
                           model.dtype, model.device)
        model.set_attn_implementation(ATTENTION)
        # A 4-D mask is used as given: this one only skips mask building, packed_attention ignores it.
        self._no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)
        self.capabilities = Capabilities(name="torch", device=str(model.device),
                                         dtype=str(model.dtype).removeprefix("torch."), feature_dim=config.hidden_size,
                                         tree_masks=True)

    @property
    def capacity_tokens(self) -> int:
        """Tokens the KV pool holds in all."""
        return self.pool.capacity_tokens

    def fill(self) -> float:
        """The fraction of the pool's pages in use."""
        return 1.0 - self.pool.free_pages / self.pool.pages

    def new_sequence(self) -> PageTable:
        """An empty page table (no pages until it grows)."""
        return PageTable(self.pool)

    def fits(self, kv: PageTable, extra: int) -> bool:
        """True if the pages `extra` more tokens need are free."""
        return kv.pages_needed(extra) <= self.pool.free_pages

    def reserve(self, kv: PageTable, extra: int) -> None:
        """Take the pages `extra` more tokens need."""
        kv.grow(extra)

    def copy_prefix(self, src: PageTable, dst: PageTable, length: int) -> None:
        """Copy `src`'s first `length` tokens' rows into pages of the empty `dst` (see Engine)."""
        dst.copy_prefix(src, length)

    def truncate(self, kv: PageTable, length: int) -> None:
        """Keep the first `length` tokens; later pages go back to the pool."""
        kv.truncate(length)

    def release(self, kv: PageTable) -> None:
        """Every page back to the pool."""
        kv.release()

    def keep_rows(self, kv: PageTable, start: int, rows: Sequence[int]) -> None:
        """Move the accepted path's keys and values to consecutive rows, then cut the rest (see Engine)."""
        moved = [(start + i, start + r) for i, r in enumerate(rows) if r != i]
        if moved:
            table = kv.rows(kv.length, self.device)
            dst = table[torch.tensor([d for d, _ in moved], device=self.device)]
            src = table[torch.tensor([s for _, s in moved], device=self.device)]
            for store in (*self.pool.keys, *self.pool.values):
                store.index_copy_(1, dst, store.index_select(1, src))  # index_select copies: overlap is safe
        kv.truncate(start + len(rows))

    @torch.inference_mode()
    def forward(self, feeds: Sequence[Feed]) -> list[Scores]:
        """Append every feed's tokens to its session in one pass.

        Returns per feed its Scores: float32 logits `[len(tokens), V]` on the model's device if it
        is scored, its final hidden states if it asked for features. Each table's length grows by
        its tokens only if the pass succeeds.
        """
        # 1. Lay the feeds out in one packed sequence.
        ids, positions, write, read, keep, rows = [], [], [], [], [], []
        queries = keys = 0
        for feed in feeds:
            past, n = feed.kv.length, len(feed.tokens)
            if n == 0:
                raise ValueError("every feed needs at least one token")
            pool_rows = feed.kv.rows(past + n, self.device)
            ids += feed.tokens
            write.append(pool_rows[past:])
            read.append(pool_rows)
            if feed.scored:
                keep.append(torch.arange(queries, queries + n, device=self.device))
            if feed.parents is not None:
                # A tree: each node at its depth's position, seeing the cache, its ancestors and itself.
                positions.append(past + torch.tensor(feed_depths(feed.parents), device=self.device))
                mask, causal = _tree_mask(feed.parents, past, self.device), False
            else:
                positions.append(torch.arange(past, past + n, device=self.device))
                mask = None if n == 1 or past == 0 else torch.ones(n, past + n, dtype=torch.bool,
                                                                   device=self.device).tril(past)
                causal = past == 0 and n > 1
            rows.append(_Row(slice(queries, queries + n), slice(keys, keys + past + n), mask, causal))
            queries += n
            keys += past + n
        # 2. One forward pass; logits only at scored positions (one throw-away row if none is). The
        #    final hidden states of every position are an intermediate of that pass anyway: they are
        #    kept only when a feed asked for them.
        cache = _PackedPass(self.pool, torch.cat(write), torch.cat(read))
        hidden: list[torch.Tensor] = []
        hook = None
        if any(feed.features for feed in feeds):
            hook = self._decoder.register_forward_hook(lambda _m, _a, output: hidden.append(_last_hidden_state(output)))
        _active.rows = rows
        try:
            out = self.model(input_ids=torch.tensor([ids], device=self.device),
                             position_ids=torch.cat(positions).unsqueeze(0), attention_mask=self._no_mask,
                             past_key_values=cache, use_cache=True,
                             logits_to_keep=torch.cat(keep) if keep else 1)
        finally:
            _active.rows = None
            if hook is not None:
                hook.remove()
        if hook is not None and len(hidden) != 1:
            raise RuntimeError(f"the decoder of {type(self.model).__name__} ran {len(hidden)} times in one pass")
        # 3. The pass wrote every feed's keys: the tokens are now cached.
        for feed in feeds:
            feed.kv.length += len(feed.tokens)
        logits = out.logits[0].float() if keep else None
        results: list[Scores] = []
        start = 0
        for feed, row in zip(feeds, rows):
            scored = None
            if feed.scored:
                scored = logits[start:start + len(feed.tokens)]
                start += len(feed.tokens)
            results.append(Scores(scored, hidden[0][0, row.queries] if feed.features else None))
        return results


def _tree_mask(parents: Sequence[int], past: int, device: torch.device) -> torch.Tensor:
    """[n, past + n]: token j sees every cached token, its ancestors among the fed ones and itself."""
    n = len(parents)
    mask = torch.zeros(n, past + n, dtype=torch.bool)
    mask[:, :past] = True
    for j, p in enumerate(parents):
        if p >= 0:
            mask[j, past:] = mask[p, past:]
        mask[j, past + j] = True
    return mask.to(device)


def _last_hidden_state(output) -> torch.Tensor:
    """The decoder's final hidden states `[1, tokens, H]`, from its output object or tuple."""
    state = getattr(output, "last_hidden_state", None)
    return state if state is not None else output[0]
