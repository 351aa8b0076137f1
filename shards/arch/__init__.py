"""Architectures written for segmentation: explicit KV cache, per-step tensors computed once.

`build_model(config, device)` returns a module whose forward is

    forward(input_ids[1,T], position_ids[1,T], past_k_0, past_v_0, ...) -> (logits, present...)

with past/present K/V [1, n_kv_heads, P, head_dim] (P may be 0) and positions P..P+T-1.
Submodules: `embed`, the per-step modules (`rotary`, `mask`, `alibi`), `layers[i].attn`,
`layers[i].mlp` and `head`; see shards/arch/common.py for the shape rules.
"""

from __future__ import annotations

import torch

from shards.arch.bloom import BloomModel
from shards.arch.common import CausalLM, cache_names, with_named_cache
from shards.arch.gpt2 import GPT2Model
from shards.arch.llama import LlamaModel
from shards.config import ModelConfig

FAMILIES: dict[str, type[CausalLM]] = {"llama": LlamaModel, "gpt2": GPT2Model, "bloom": BloomModel}

__all__ = ["CausalLM", "FAMILIES", "build_model", "cache_names", "empty_cache"]


def build_model(config: ModelConfig, device: str = "cpu") -> CausalLM:
    """The model for `config`, randomly initialised on "cpu" or without storage on "meta"."""
    if device not in ("cpu", "meta"):
        raise ValueError(f"device must be 'cpu' or 'meta', not {device!r}")
    model_class = with_named_cache(FAMILIES[config.family], config.num_layers)
    with torch.device(device):
        model = model_class(config)
    return model.requires_grad_(False).eval()


def empty_cache(config: ModelConfig) -> list[torch.Tensor]:
    """Past K/V for a fresh sequence: 2 * num_layers tensors [1, n_kv_heads, 0, head_dim]."""
    shape = (1, config.num_kv_heads, 0, config.head_dim)
    return [torch.zeros(shape) for _ in range(2 * config.num_layers)]
