"""The EAGLE draft head (Li et al., arXiv 2401.15077): drafting from the target's own features.

The target's final hidden state at position i (its "feature" f_i, what its output head turns into
the distribution of token i+1) carries far more than the token ids do. The head predicts the next
feature from the previous feature and the next token's embedding:

    f^_i = Decoder(fc([f_{i-1} ; e(t_i)]))        q_i = softmax(W_head[head_ids] f^_i)

with decoder layers of the target's shape (EAGLE uses one), the target's frozen embeddings e and the
frequency ranked rows `head_ids` of its output head W_head. Positions whose previous feature is known come
from the verifier (true features); inside a draft block the head feeds its own predictions forward.
This module holds the model and reads its checkpoints; distill/eagle.py trains it, edge/eagle.py
drafts with it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModel, GenerationConfig, PretrainedConfig

def body_config(target_config: PretrainedConfig, num_layers: int = 1) -> PretrainedConfig:
    """The head's decoder layers: the target's shape, no vocabulary (it is fed embeddings)."""
    config = AutoConfig.for_model(**{**target_config.to_dict(), "num_hidden_layers": num_layers, "vocab_size": 1,
                                     "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
                                     "tie_word_embeddings": False})
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    return config

class EagleHead(nn.Module):
    """fc + decoder layer(s) (+ final norm) over [feature ; embedding]; frozen embeddings and head rows."""

    is_eagle_head = True

    def __init__(self, target_config: PretrainedConfig, embed: torch.Tensor, head_rows: torch.Tensor,
                 head_ids: torch.Tensor, num_layers: int = 1) -> None:
        super().__init__()
        hidden = target_config.hidden_size
        self.config = body_config(target_config, num_layers)
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        self.body = AutoModel.from_config(self.config)
        self.body.embed_tokens = None  # fed embeddings; the vocabulary lives in `embed`
        self.register_buffer("embed", embed, persistent=False)
        self.register_buffer("head", head_rows, persistent=False)
        self.register_buffer("head_ids", head_ids.long(), persistent=False)
        self.generation_config = GenerationConfig()

    @property
    def hidden_size(self) -> int:
        """Size of a feature vector."""
        return self.fc.out_features

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def get_input_embeddings(self) -> nn.Embedding:
        """The target's embeddings (their rows are the vocabulary this head drafts in)."""
        return nn.Embedding.from_pretrained(self.embed, freeze=True)

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, position_ids: torch.Tensor,
                cache=None, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Predicted features [B, T, H] for inputs (features [B, T, H], tokens [B, T]).

        features[:, j] is the feature *before* tokens[:, j]; the output at j predicts the feature at
        tokens[:, j], i.e. the distribution of the token after it.
        """
        x = self.fc(torch.cat([features.to(self.dtype), F.embedding(tokens, self.embed)], dim=-1))
        out = self.body(inputs_embeds=x, position_ids=position_ids, past_key_values=cache,
                        use_cache=cache is not None, attention_mask=attention_mask)
        return out.last_hidden_state

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Logits over the head's rows (`head_ids`) for features [..., H]."""
        return features.to(self.head.dtype) @ self.head.T
