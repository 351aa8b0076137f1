"""Rotary position embeddings with the Hugging Face scaling variants (linear, dynamic, llama3),
and llama.cpp's per-frequency divisors (a GGUF file's `rope_freqs`, which is how the converter
stores Llama 3 scaling)."""

from __future__ import annotations

import math

import torch
from torch import nn

from shards.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """The static inverse frequencies, [head_dim / 2] float32 (dynamic scaling adjusts later)."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling or {"rope_type": "default"}
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "llama3":
        return _llama3(inv_freq, scaling)
    if scaling["rope_type"] == "freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32, device="cpu")
    return inv_freq


def _llama3(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """position_ids [B, T] -> (cos, sin), each [B, 1, T, head_dim], shared by every layer."""

    inv_freq: torch.Tensor  # a buffer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(config), persistent=False)
        scaling = config.rope_scaling or {}
        self.dynamic_factor = scaling["factor"] if scaling.get("rope_type") == "dynamic" else None
        self.theta = config.rope_theta
        self.head_dim = config.head_dim
        self.max_positions = config.max_positions

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        factor = self.dynamic_factor
        inv_freq = self.inv_freq if factor is None else self._ntk(position_ids, factor)
        freqs = position_ids[..., None].float() * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)[:, None]
        return angles.cos(), angles.sin()

    def _ntk(self, position_ids: torch.Tensor, factor: float) -> torch.Tensor:
        """Dynamic NTK: the base grows once the sequence outgrows max_positions; [B, 1,
        head_dim / 2], each sequence of the batch by its own length."""
        seq_len = torch.clamp(position_ids.amax(-1) + 1, min=self.max_positions).float()
        dim = self.head_dim
        growth = factor * seq_len / self.max_positions - (factor - 1)
        base = self.theta * growth ** (dim / (dim - 2))
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (base[:, None, None] ** exponents)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply the rotation to [B, heads, T, head_dim] queries or keys."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
