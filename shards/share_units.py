"""A layer's attention and MLP cut into tensor-parallel shares, as torch modules and ONNX units.

A share (shards.share_split) of a layer's attention holds the query, key and value
projections of its KV-head groups and the matching input columns of the output projection;
it reads the normed hidden state of every row of the step, the per-step tensors (rotary
cos/sin, the mask) and the past K/V of its own KV heads, and gives its partial output
projection, without the residual, and its heads' present K/V. A share of the MLP holds its
intermediate columns of the up (and gate) projection and the matching rows of the down
projection: normed hidden -> partial down projection. The partials of all shares sum to
the block's output. The biases of the row-split projections (o_proj / c_proj / dense, and
the MLP's down projection) are added by share 0 only: every other share holds zeros there.

The families lay their weights out differently: Llama's q/k/v are separate, with GQA (a
share's query heads are the num_heads / num_kv_heads heads of each of its KV heads);
GPT-2's Conv1D stores [in, out] with the fused c_attn as [q | k | v] columns; BLOOM's fused
query_key_value is laid out [heads, (q, k, v), head_dim] and each head has its own ALiBi
slope, so a share takes its heads' rows and slopes.

The pre-norms are kept as numpy `shards.share_layout.Norm`s, for the runner.

`export_shares` writes every (layer, half, share) unit with torch.onnx (shards.export's
exporter) and checks it in ONNX Runtime against the torch share module, as export checks
the model's units.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

from shards import examples
from shards.arch import CausalLM
from shards.arch.bloom import BloomAttention, BloomMLP
from shards.arch.common import Layer
from shards.arch.gpt2 import GPT2MLP, GPT2Attention
from shards.arch.llama import LlamaAttention, LlamaMLP
from shards.checkpoint import load_model
from shards.config import ModelConfig, load_config
from shards.executor import session_options
from shards.export import disagreement, to_onnx
from shards.manifest import Manifest
from shards.onnx_file import write_unit
from shards.share_layout import (
    ATTN,
    MLP,
    NORMED,
    PARTIAL,
    PAST,
    PRESENT,
    Norm,
    ShareUnit,
    ShareUnits,
    step_inputs,
)
from shards.share_split import LayerShape, Share, ShareError, Span, split_layer
from shards.template import Names, Template, learn

_AXES_CASES = (examples.EXPORT, examples.MORE_TOKENS, examples.MORE_PAST,
               examples.MORE_SEQUENCES)


class AttentionShare(nn.Module):
    """(normed hidden, mask, past_k, past_v) -> (partial, present_k, present_v)."""

    attn: Any  # a family's attention module, narrowed to the share (its `branch`)

    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.attn = attn

    def forward(self, normed, mask, past_k, past_v):
        return self.attn.branch(normed, mask, past_k, past_v)


class RotaryAttentionShare(AttentionShare):
    """(normed hidden, cos, sin, mask, past_k, past_v) -> (partial, present_k, present_v):
    torch.export names one input per parameter, so each arity has its own signature."""

    def forward(self, normed, cos, sin, mask, past_k, past_v):  # pyright: ignore[reportIncompatibleMethodOverride]
        return self.attn.branch(normed, cos, sin, mask, past_k, past_v)


class MLPShare(nn.Module):
    """normed hidden -> partial down projection."""

    mlp: Any  # a family's MLP module, narrowed to the share (its `branch`)

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp

    def forward(self, normed):
        return self.mlp.branch(normed)


def share_modules(model: CausalLM, layer: int, share: Share) -> tuple[AttentionShare, MLPShare]:
    """The torch modules of one share of `layer` of a loaded model."""
    config = model.config
    family = _FAMILIES[config.family]
    full = _layer(model, layer)
    narrow = dataclasses.replace(config, num_heads=share.heads.size,
                                 num_kv_heads=share.kv_heads.size,
                                 intermediate_size=share.columns.size)
    attn_params = family.attention_params(full.attn.state_dict(), share, config.head_dim)
    mlp_params = family.mlp_params(full.mlp.state_dict(), share.columns)
    if share.index > 0:
        _zero(attn_params, family.attention_bias)
        _zero(mlp_params, family.mlp_bias)
    attn = _loaded(family.attention(narrow, layer), attn_params)
    if family.slopes:
        slopes = full.attn.get_buffer("slopes")[share.heads.start : share.heads.stop]
        attn.register_buffer("slopes", slopes.clone(), persistent=False)
    return family.share(attn), MLPShare(_loaded(family.mlp(narrow), mlp_params))


def _layer(model: CausalLM, index: int) -> Layer:
    return cast("Layer", model.layers[index])  # ModuleList is untyped


def _zero(params: dict[str, torch.Tensor], bias: str) -> None:
    """Share 0 alone adds the bias of a row-split projection (if it has one)."""
    if bias in params:
        params[bias] = torch.zeros_like(params[bias])


def _loaded(module: nn.Module, params: dict[str, torch.Tensor]) -> nn.Module:
    module.norm = nn.Identity()  # the runner norms the rows itself
    module.load_state_dict({k: v.clone() for k, v in params.items()}, strict=True, assign=True)
    return module.requires_grad_(False).eval()


def _norm(norm: nn.Module, eps: float) -> Norm:
    params = {name: _array(p) for name, p in norm.named_parameters()}
    return Norm(params["weight"], params.get("bias"), eps)


def _array(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().numpy().astype(np.float32)


# -- per-family slicing of a block's state dict ---------------------------------------------------
Params = dict[str, torch.Tensor]


def _rows(span: Span, dim: int) -> slice:
    return slice(span.start * dim, span.stop * dim)


def _llama_attention(full: Params, share: Share, dim: int) -> Params:
    queries, keys = _rows(share.heads, dim), _rows(share.kv_heads, dim)
    params = {f"{name}.{leaf}": full[f"{name}.{leaf}"][rows]
              for name, rows in (("q_proj", queries), ("k_proj", keys), ("v_proj", keys))
              for leaf in ("weight", "bias") if f"{name}.{leaf}" in full}
    params["o_proj.weight"] = full["o_proj.weight"][:, queries]
    return params | {k: v for k, v in full.items() if k == "o_proj.bias"}


def _gpt2_attention(full: Params, share: Share, dim: int) -> Params:
    heads, hidden = _rows(share.heads, dim), full["c_proj.weight"].shape[1]
    parts = [slice(heads.start + k * hidden, heads.stop + k * hidden) for k in range(3)]
    return {
        "c_attn.weight": torch.cat([full["c_attn.weight"][:, p] for p in parts], dim=1),
        "c_attn.bias": torch.cat([full["c_attn.bias"][p] for p in parts]),
        "c_proj.weight": full["c_proj.weight"][heads],  # Conv1D: [in, out]
        "c_proj.bias": full["c_proj.bias"],
    }


def _bloom_attention(full: Params, share: Share, dim: int) -> Params:
    fused = _rows(share.heads, 3 * dim)  # [heads, (q, k, v), head_dim] rows
    return {
        "query_key_value.weight": full["query_key_value.weight"][fused],
        "query_key_value.bias": full["query_key_value.bias"][fused],
        "dense.weight": full["dense.weight"][:, _rows(share.heads, dim)],
        "dense.bias": full["dense.bias"],
    }


def _column_mlp(up: tuple[str, ...], down: str, stored_in_out: bool):
    """The params of an MLP share of `columns`: the `up` projections' output columns, the
    `down` projection's input columns (GPT-2's Conv1D stores [in, out], the others [out, in])."""

    def params(full: Params, columns: Span) -> Params:
        cols = slice(columns.start, columns.stop)
        out_cols, in_cols = ((slice(None), cols), (cols,)) if stored_in_out else (
            (cols,), (slice(None), cols))
        out = {f"{name}.weight": full[f"{name}.weight"][out_cols] for name in up}
        out |= {f"{name}.bias": full[f"{name}.bias"][cols] for name in up
                if f"{name}.bias" in full}
        out[f"{down}.weight"] = full[f"{down}.weight"][in_cols]
        return out | {k: v for k, v in full.items() if k == f"{down}.bias"}

    return params


@dataclass(frozen=True)
class _Family:
    attention: Callable[[ModelConfig, int], nn.Module]
    attention_params: Callable[[Params, Share, int], Params]
    attention_bias: str  # the row-split projection's bias, added by share 0 only
    mlp: Callable[[ModelConfig], nn.Module]
    mlp_params: Callable[[Params, Span], Params]
    mlp_bias: str
    share: type[AttentionShare] = AttentionShare
    slopes: bool = False  # ALiBi: a slope per head


_FAMILIES = {
    "llama": _Family(LlamaAttention, _llama_attention, "o_proj.bias", LlamaMLP,
                     _column_mlp(("gate_proj", "up_proj"), "down_proj", False), "down_proj.bias",
                     RotaryAttentionShare),
    "gpt2": _Family(GPT2Attention, _gpt2_attention, "c_proj.bias", GPT2MLP,
                    _column_mlp(("c_fc",), "c_proj", True), "c_proj.bias"),
    "bloom": _Family(lambda config, _layer: BloomAttention(config), _bloom_attention,
                     "dense.bias", BloomMLP,
                     _column_mlp(("dense_h_to_4h",), "dense_4h_to_h", False),
                     "dense_4h_to_h.bias", slopes=True),
}


def shares_for(model: str | Path, manifest: Manifest, weights: Sequence[float],
               directory: Path, layers: Iterable[int] | None = None) -> ShareUnits:
    """The share units of the model at `model` (sharded as `manifest`) for `weights`,
    written into `directory` (of `layers` only, where given). The split is checked before
    the model is loaded."""
    config = load_config(model)
    split_layer(LayerShape.of(config), weights)
    _, loaded = load_model(model)
    attention = next(u for u in manifest.units if u.name == f"layer0.{ATTN}")
    return export_shares(loaded, weights, step_inputs(attention), directory, layers)


# -- export ------------------------------------------------------------------------------------
def export_shares(model: CausalLM, weights: Sequence[float], step_names: Sequence[str],
                  directory: Path, layers: Iterable[int] | None = None) -> ShareUnits:
    """Split every layer of the loaded `model` into shares by `weights` and write each share
    unit into `directory`, checked against torch. `step_names` are the per-step tensors an
    attention unit reads, in the manifest's order (e.g. rotary.cos, rotary.sin, mask)."""
    config = model.config
    shares = split_layer(LayerShape.of(config), weights)
    units: dict[tuple[int, str, int], ShareUnit] = {}
    norms: dict[tuple[int, str], Norm] = {}
    exporter = _ShareExporter(directory)
    for layer in range(config.num_layers) if layers is None else layers:
        blocks = _layer(model, layer)
        norms[(layer, ATTN)] = _norm(blocks.attn.get_submodule("norm"), config.norm_eps)
        norms[(layer, MLP)] = _norm(blocks.mlp.get_submodule("norm"), config.norm_eps)
        for share in shares:
            attn, mlp = share_modules(model, layer, share)
            kv_heads = share.kv_heads.size
            units[(layer, ATTN, share.index)] = exporter.unit(
                attn, _attention_runs(model, layer, attn, kv_heads),
                ((NORMED, *step_names, *PAST), (PARTIAL, *PRESENT)), (layer, ATTN, share.index))
            units[(layer, MLP, share.index)] = exporter.unit(
                mlp, _mlp_runs(model, layer, mlp), ((NORMED,), (PARTIAL,)),
                (layer, MLP, share.index))
    return ShareUnits(shares, tuple(float(w) for w in weights), units, norms,
                      config.residual_post_norm)


class _ShareExporter:
    """Writes share units into `directory`. The first unit of each shape (the same half,
    module, parameter and example shapes: a later layer, or a share as wide as an earlier
    one) is exported with torch.onnx, seconds each; the others get its graph with their own
    weights (shards.template), kept only where ONNX Runtime then computes what torch does."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.graphs: dict[tuple, Template] = {}

    def unit(self, module: nn.Module, runs: dict, names: Names,
             key: tuple[int, str, int]) -> ShareUnit:
        layer, half, share = key
        inputs, outputs = names
        relative = f"layer{layer:03d}-{half}-share{share}.onnx"
        shape = _shape(half, module, runs)
        args, expected = runs[examples.EXPORT]
        with tempfile.TemporaryDirectory(dir=self.directory) as scratch_name:
            scratch = Path(scratch_name)
            path = scratch / relative
            known = self.graphs.get(shape)
            written = None if known is None else known.apply(names, module, scratch, relative)
            if written is None or _disagreement(path, names, args, expected):
                staged = to_onnx(module, list(inputs), list(outputs), runs, scratch)
                self.graphs.setdefault(shape, learn(staged, relative, names, module))
                written = write_unit(staged, scratch, relative)
                problem = _disagreement(path, names, args, expected)
                if problem is not None:
                    raise ShareError(f"share {share} of layer {layer}'s {half}: {problem}")
            for file in written.files:
                os.replace(scratch / file.name, self.directory / file.name)
        return ShareUnit(layer, half, share, self.directory / relative, tuple(inputs),
                         tuple(outputs), written.files)


def _shape(half: str, module: nn.Module, runs: dict) -> tuple:
    """What two share units have in common when one's graph can serve the other."""
    params = tuple((name, tuple(p.shape), p.dtype) for name, p in module.named_parameters())
    shapes = tuple((case, tuple(tuple(a.shape) for a in args))
                   for case, (args, _) in sorted(runs.items()))
    return half, type(module).__name__, params, shapes


def _disagreement(path: Path, names: Names, args: tuple, expected: tuple) -> str | None:
    session = ort.InferenceSession(str(path), session_options(),
                                   providers=["CPUExecutionProvider"])
    inputs, outputs = names
    return disagreement(session, inputs, outputs, args, expected, exact=True)


def _attention_runs(model: CausalLM, layer: int, module: nn.Module, kv_heads: int) -> dict:
    """(args, outputs) of the attention share on each example case that tells axes apart."""
    runs = {}
    generator = torch.Generator().manual_seed(layer)
    config = model.config
    for case_name in _AXES_CASES:
        case = examples.cases(config)[case_name]
        ids = torch.randint(0, config.vocab_size, (case.batch, case.tokens), generator=generator)
        positions = torch.arange(case.past, case.past + case.tokens).expand(ids.shape)
        with torch.no_grad():
            hidden, step = model.prepare(ids, positions)
            normed = _layer(model, layer).attn.get_submodule("norm")(hidden)
            past = [torch.randn(case.batch, kv_heads, case.past, config.head_dim,
                                generator=generator) for _ in PAST]
            args = (normed, *step, *past)
            runs[case_name] = (args, module(*args))
    return runs


def _mlp_runs(model: CausalLM, layer: int, module: nn.Module) -> dict:
    runs = {}
    generator = torch.Generator().manual_seed(layer)
    for case_name in _AXES_CASES:
        case = examples.cases(model.config)[case_name]
        hidden = torch.randn(case.batch, case.tokens, model.config.hidden_size,
                             generator=generator)
        with torch.no_grad():
            args = (_layer(model, layer).mlp.get_submodule("norm")(hidden),)
            runs[case_name] = (args, (module(*args),))
    return runs
