"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM, TinyLlama): RMSNorm, RoPE, GQA,
SwiGLU, optional qkv bias, optional sliding window, optionally tied embeddings."""

from __future__ import annotations

import torch
from torch import nn

from shards.arch.common import (
    CausalLM,
    CausalMask,
    Head,
    Layer,
    RMSNorm,
    activation,
    attend,
    causal_bias,
    key_positions,
    split_heads,
)
from shards.arch.rope import RotaryEmbedding, rotate
from shards.config import ModelConfig


class TokenEmbedding(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(config.vocab_size, config.hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(input_ids)


class LlamaAttention(nn.Module):
    """Pre-norm attention with RoPE and GQA, plus the residual add."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        hidden, dim = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, dim
        self.norm = RMSNorm(hidden, config.norm_eps)
        self.q_proj = nn.Linear(hidden, self.heads * dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(hidden, self.kv_heads * dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(hidden, self.kv_heads * dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.heads * dim, hidden, bias=config.o_bias)
        self.window = config.window(layer)
        self.scale = dim**-0.5

    def forward(self, hidden, cos, sin, mask, past_k, past_v):
        out, key, value = self.branch(self.norm(hidden), cos, sin, mask, past_k, past_v)
        return hidden + out, key, value

    def branch(self, x, cos, sin, mask, past_k, past_v):
        """What attention adds to the residual stream, from the normed hidden state `x`."""
        query = rotate(split_heads(self.q_proj(x), self.heads, self.head_dim), cos, sin)
        key = rotate(split_heads(self.k_proj(x), self.kv_heads, self.head_dim), cos, sin)
        value = split_heads(self.v_proj(x), self.kv_heads, self.head_dim)
        key = torch.cat((past_k, key), dim=2)
        value = torch.cat((past_v, value), dim=2)
        keys = key_positions(mask, past_k.shape[2], key.shape[2])
        bias = causal_bias(mask, keys, self.window)
        out = attend(query, key, value, bias, self.scale, self.heads // self.kv_heads)
        return self.o_proj(out), key, value


class LlamaMLP(nn.Module):
    """Pre-norm gated MLP (SwiGLU), plus the residual add."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.norm = RMSNorm(hidden, config.norm_eps)
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)
        self.act = activation(config.activation)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.branch(self.norm(hidden))

    def branch(self, x: torch.Tensor) -> torch.Tensor:
        """What the MLP adds to the residual stream, from the normed hidden state `x`."""
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class LlamaModel(CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.embed = TokenEmbedding(config)
        self.rotary = RotaryEmbedding(config)
        self.mask = CausalMask()
        self.layers = nn.ModuleList(
            Layer(LlamaAttention(config, i), LlamaMLP(config)) for i in range(config.num_layers)
        )
        self.head = Head(RMSNorm(config.hidden_size, config.norm_eps), config.hidden_size,
                         config.vocab_size)

    def prepare(self, input_ids, position_ids):
        cos, sin = self.rotary(position_ids)
        return self.embed(input_ids), (cos, sin, self.mask(position_ids))
