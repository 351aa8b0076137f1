"""Pieces every architecture shares: the model skeleton with an explicit KV cache, the causal
mask, attention, normalisation and activations.

Shapes follow one rule so that any unit of a segmented model only needs its own inputs: the
per-step tensors (`CausalMask`, rotary cos/sin) describe the T new positions and are
computed once near the input; each attention extends them over its own P cached keys using
the shape of its own past K. Nothing has a shape that depends on tensor values, so torch.fx
tracing and ONNX export see plain shapes.

A step runs B sequences at once (the batch axis, first everywhere). Their caches differ in
length, so each sequence's cache is left-padded to the longest, P: a sequence with L cached
positions has P - L padding keys first, then its own. Its new tokens stand at positions
L, L+1, ... (positions within a step are consecutive), which is how an attention tells its
padding from its keys (`causal_bias`): key j of a sequence stands at position j - P + L.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from shards.config import ModelConfig
from shards.errors import ModelError

NEG_INF = torch.finfo(torch.float32).min  # additive mask value, as Hugging Face uses


def cache_names(num_layers: int, prefix: str) -> list[str]:
    """["{prefix}_k_0", "{prefix}_v_0", "{prefix}_k_1", ...]: past (inputs) or present (outputs)."""
    return [f"{prefix}_{kind}_{layer}" for layer in range(num_layers) for kind in "kv"]


class CausalLM(nn.Module):
    """embed → per-step tensors → layers[i].attn / layers[i].mlp → head, float32.

    Subclasses build `embed`, `layers` and `head` and implement `prepare`, which embeds the
    tokens and computes the per-step tensors every attention receives after `hidden`.
    `build_model` gives each instance a `forward` with one named argument per cache tensor.
    """

    layers: nn.ModuleList  # of Layer
    head: nn.Module

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config

    def prepare(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        raise NotImplementedError

    def run(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, past: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, ...]:
        hidden, step = self.prepare(input_ids, position_ids)
        present = []
        for i, layer in enumerate(cast("Iterable[Layer]", self.layers)):  # ModuleList is untyped
            hidden, key, value = layer.attn(hidden, *step, past[2 * i], past[2 * i + 1])
            hidden = layer.mlp(hidden)
            present += [key, value]
        return (self.head(hidden), *present)


@functools.cache
def with_named_cache(cls: type[CausalLM], num_layers: int) -> type[CausalLM]:
    """A subclass of `cls` whose forward names every cache tensor (past_k_0, past_v_0, ...).

    torch.fx and torch.onnx name graph inputs after the forward's parameters, and a `*past`
    would become one opaque tuple input; generating the signature keeps one input per tensor.
    """
    names = ", ".join(cache_names(num_layers, "past"))
    source = (
        f"def forward(self, input_ids, position_ids, {names}):\n"
        f"    return self.run(input_ids, position_ids, ({names},))\n"
    )
    namespace: dict = {}
    exec(source, namespace)  # the source is built from integers only
    return type(f"{cls.__name__}{num_layers}", (cls,), {"forward": namespace["forward"]})


class Layer(nn.Module):
    """One transformer layer as two separately callable halves: `attn` and `mlp`."""

    def __init__(self, attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.attn = attn
        self.mlp = mlp


class Head(nn.Module):
    """Final norm and LM head; `lm_head` has its own weight even when tied to the embedding."""

    def __init__(self, norm: nn.Module, hidden_size: int, vocab_size: int) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


class CausalMask(nn.Module):
    """position_ids [B, T] -> [B, 1, T, 1]: where the new queries stand, from which each
    attention builds its bias over its keys (`causal_bias`)."""

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return position_ids[:, None, :, None]


def key_positions(queries: torch.Tensor, past_len, key_len) -> torch.Tensor:
    """[B, 1, T, 1] query positions -> [B, 1, 1, key_len]: the position of each of the
    `past_len` cached (left-padded) and the new keys; padding stands before position 0.

    Written from `past_len` and `key_len` first: a value computed from the queries alone
    would be hoisted into unit 0 and sent to every attention (docs/architecture.md)."""
    offsets = (queries - past_len)[:, :, :1, :]  # the first query's position, less past_len
    return torch.arange(key_len) + offsets


def causal_bias(queries: torch.Tensor, keys: torch.Tensor,
                window: int | None = None) -> torch.Tensor:
    """[B, 1, T, P+T] additive bias: 0 where a query sees a key (a key at or before it, not
    padding, and with `window`, fewer than `window` positions behind; Mistral's sliding
    window), NEG_INF elsewhere."""
    visible = (keys >= 0) & (keys <= queries)
    if window is not None:
        visible = visible & (queries - keys < window)
    return torch.where(visible, 0.0, NEG_INF)


def split_heads(x: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """[B, T, heads*head_dim] -> [B, heads, T, head_dim]."""
    return x.unflatten(-1, (num_heads, head_dim)).transpose(1, 2)


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
    groups: int = 1,
) -> torch.Tensor:
    """Softmax attention over [B, heads, *, head_dim]; key/value have heads/groups heads
    (grouped-query attention), and with groups > 1 the bias is one for every head
    ([B, 1, T, P+T]). Returns [B, T, heads*head_dim].

    The `groups` query heads that share a key/value head are multiplied with it as one
    matrix of groups*T rows (the bias repeated to match), instead of repeating the key and
    value per query head: that repeat copied the layer's whole K/V on every step, and in
    ONNX Runtime's profile of an int4 decode step it was the costliest operator after the
    MatMuls. Together with RMSNorm's fused form: int4 decode of the 24-layer hidden-1024
    model 55.2 -> 62.2 tokens/s, float32 19.5 -> 20.3 (medians of 6 rounds, one process)."""
    heads = query.shape[1]
    grouped = query.unflatten(1, (heads // groups, groups)).flatten(2, 3)  # rows: (member, t)
    if groups > 1:
        bias = bias.repeat(1, 1, groups, 1)
    scores = torch.matmul(grouped, key.transpose(2, 3)) * scale + bias
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, value).unflatten(2, (groups, -1)).flatten(1, 2)
    return out.transpose(1, 2).flatten(2)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x / sqrt(...) rather than transformers' x * rsqrt(...): ONNX Runtime fuses this
        # form into one SimplifiedLayerNormalization, the other stays seven operators
        return self.weight * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))
    return 0.5 * x * (1.0 + torch.tanh(inner))


def _bloom_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


# Hugging Face activation names, written as the transformers implementations compute them.
ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "bloom_gelu": _bloom_gelu,
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ModelError(f"unsupported activation: {name}")
    return ACTIVATIONS[name]
