"""The target's final hidden states as wire bytes and back (pure functions on tensors).

The verifier encodes the features an eagle drafter asked for (cloud/core/verifier.py); the edge decodes
them (edge/eagle.py). int8 stores each vector as int8 values with one fp16 scale, symmetric around
zero (scale = max |value| / 127): a vector of H values costs H + 2 bytes instead of 2H for fp16.
"""
from __future__ import annotations

import torch

from ..protocol.wire import FeatureBlock, FeatureFormat


def encode_features(hidden: torch.Tensor, start: int, fmt: FeatureFormat) -> FeatureBlock:
    """`hidden` [n, H] (any float dtype, any device) as a FeatureBlock starting at position `start`."""
    if fmt is FeatureFormat.NONE:
        raise ValueError("encode_features needs a format other than NONE")
    h = hidden.detach().to("cpu", torch.float32)
    n, dim = h.shape
    if fmt is FeatureFormat.FP16:
        return FeatureBlock(start, n, dim, fmt, h.to(torch.float16).numpy().tobytes())
    scale = (h.abs().amax(dim=1) / 127.0).clamp(min=1e-8).to(torch.float16)
    q = torch.round(h / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return FeatureBlock(start, n, dim, fmt, q.numpy().tobytes(), scale.numpy().tobytes())


def decode_features(block: FeatureBlock) -> torch.Tensor:
    """The float32 [count, dim] vectors of a (validated) FeatureBlock."""
    if block.format is FeatureFormat.FP16:
        values = torch.frombuffer(bytearray(block.data), dtype=torch.float16)
        return values.view(block.count, block.dim).float()
    values = torch.frombuffer(bytearray(block.data), dtype=torch.int8).view(block.count, block.dim).float()
    scales = torch.frombuffer(bytearray(block.scales), dtype=torch.float16).float()
    return values * scales[:, None]


def join_blocks(blocks: list[FeatureBlock]) -> FeatureBlock:
    """Consecutive blocks of one format as one block (a prompt's features arrive chunk by chunk)."""
    first = blocks[0]
    for prev, nxt in zip(blocks, blocks[1:]):
        if nxt.start != prev.start + prev.count or nxt.format is not first.format or nxt.dim != first.dim:
            raise ValueError("join_blocks needs consecutive blocks of one format and size")
    return FeatureBlock(first.start, sum(b.count for b in blocks), first.dim, first.format,
                        b"".join(b.data for b in blocks), b"".join(b.scales for b in blocks))
