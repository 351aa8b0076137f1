"""BLOOM: embedding LayerNorm, fused per-head qkv, ALiBi position bias, GELU MLP, tied head."""

from __future__ import annotations

import math

import torch
from torch import nn

from shards.arch.common import (
    CausalLM,
    CausalMask,
    Head,
    Layer,
    activation,
    attend,
    causal_bias,
    key_positions,
)
from shards.config import ModelConfig


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """Per-head ALiBi slopes, [num_heads] float32, as Hugging Face computes them."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2 ** (-(2 ** -(math.log2(closest) - 3)))
    slopes = [base**power for power in range(1, closest + 1)]
    if closest != num_heads:
        extra_base = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
        extra = min(closest, num_heads - closest)
        slopes += [extra_base**power for power in range(1, 2 * extra, 2)]
    return torch.tensor(slopes, dtype=torch.float32, device="cpu")


class BloomEmbedding(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.tokens(input_ids))


class BloomAttention(nn.Module):
    slopes: torch.Tensor  # a buffer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.heads, self.head_dim = config.num_heads, config.head_dim
        width = self.heads * self.head_dim  # hidden, but for a share of the heads
        self.norm = nn.LayerNorm(hidden, eps=config.norm_eps)
        self.query_key_value = nn.Linear(hidden, 3 * width)
        self.dense = nn.Linear(width, hidden)
        self.register_buffer("slopes", alibi_slopes(config.num_heads), persistent=False)
        self.residual_post_norm = config.residual_post_norm
        self.scale = 1.0 / math.sqrt(self.head_dim)

    def forward(self, hidden, mask, past_k, past_v):
        x = self.norm(hidden)
        residual = x if self.residual_post_norm else hidden
        out, key, value = self.branch(x, mask, past_k, past_v)
        return residual + out, key, value

    def branch(self, x, mask, past_k, past_v):
        """What attention adds to the residual stream, from the normed hidden state `x`."""
        # Hugging Face lays the fused projection out as [heads, (q, k, v), head_dim].
        fused = self.query_key_value(x).unflatten(-1, (self.heads, 3, self.head_dim))
        query, key, value = (fused[..., i, :].transpose(1, 2) for i in range(3))
        key = torch.cat((past_k, key), dim=2)
        value = torch.cat((past_v, value), dim=2)
        keys = key_positions(mask, past_k.shape[2], key.shape[2])
        alibi = self.slopes[None, :, None, None] * keys.float()  # [B, heads, 1, P+T]
        bias = alibi + causal_bias(mask, keys)
        out = attend(query, key, value, bias, self.scale)
        return self.dense(out), key, value


class BloomMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.norm = nn.LayerNorm(hidden, eps=config.norm_eps)
        self.dense_h_to_4h = nn.Linear(hidden, config.intermediate_size)
        self.dense_4h_to_h = nn.Linear(config.intermediate_size, hidden)
        self.act = activation(config.activation)
        self.residual_post_norm = config.residual_post_norm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = self.norm(hidden)
        residual = x if self.residual_post_norm else hidden
        return residual + self.branch(x)

    def branch(self, x: torch.Tensor) -> torch.Tensor:
        """What the MLP adds to the residual stream, from the normed hidden state `x`."""
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class BloomModel(CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.embed = BloomEmbedding(config)
        self.mask = CausalMask()
        self.layers = nn.ModuleList(
            Layer(BloomAttention(config), BloomMLP(config)) for _ in range(config.num_layers)
        )
        norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.head = Head(norm, config.hidden_size, config.vocab_size)

    def prepare(self, input_ids, position_ids):
        return self.embed(input_ids), (self.mask(position_ids),)
