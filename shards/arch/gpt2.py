"""GPT-2: learned position embeddings, LayerNorm, fused qkv, GELU MLP, tied LM head."""

from __future__ import annotations

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
    split_heads,
)
from shards.config import ModelConfig


class Conv1D(nn.Module):
    """GPT-2's linear layer: weight stored [in, out], so checkpoints load without transposing."""

    def __init__(self, size_in: int, size_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size_in, size_out))
        self.bias = nn.Parameter(torch.zeros(size_out))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight)
        return out.view(x.shape[0], -1, self.weight.shape[1])


class GPT2Embedding(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.positions = nn.Embedding(config.max_positions, config.hidden_size)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(input_ids) + self.positions(position_ids)


class GPT2Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.heads, self.head_dim = config.num_heads, config.head_dim
        width = self.heads * self.head_dim  # hidden, but for a share of the heads
        self.norm = nn.LayerNorm(hidden, eps=config.norm_eps)
        self.c_attn = Conv1D(hidden, 3 * width)
        self.c_proj = Conv1D(width, hidden)
        self.scale = self.head_dim**-0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_layer:
            self.scale /= float(layer + 1)

    def forward(self, hidden, mask, past_k, past_v):
        out, key, value = self.branch(self.norm(hidden), mask, past_k, past_v)
        return hidden + out, key, value

    def branch(self, x, mask, past_k, past_v):
        """What attention adds to the residual stream, from the normed hidden state `x`."""
        query, key, value = self.c_attn(x).chunk(3, dim=2)
        query = split_heads(query, self.heads, self.head_dim)
        key = torch.cat((past_k, split_heads(key, self.heads, self.head_dim)), dim=2)
        value = torch.cat((past_v, split_heads(value, self.heads, self.head_dim)), dim=2)
        bias = causal_bias(mask, key_positions(mask, past_k.shape[2], key.shape[2]))
        out = attend(query, key, value, bias, self.scale)
        return self.c_proj(out), key, value


class GPT2MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.c_fc = Conv1D(config.hidden_size, config.intermediate_size)
        self.c_proj = Conv1D(config.intermediate_size, config.hidden_size)
        self.act = activation(config.activation)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.branch(self.norm(hidden))

    def branch(self, x: torch.Tensor) -> torch.Tensor:
        """What the MLP adds to the residual stream, from the normed hidden state `x`."""
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Model(CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.embed = GPT2Embedding(config)
        self.mask = CausalMask()
        self.layers = nn.ModuleList(
            Layer(GPT2Attention(config, i), GPT2MLP(config)) for i in range(config.num_layers)
        )
        norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.head = Head(norm, config.hidden_size, config.vocab_size)

    def prepare(self, input_ids, position_ids):
        return self.embed(input_ids, position_ids), (self.mask(position_ids),)
