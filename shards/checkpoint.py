"""Hugging Face safetensors checkpoints -> our parameters, one tensor at a time if need be.

`param_sources` maps each of our parameter names to the checkpoint tensor it comes from (a
tied LM head maps to the embedding tensor, so a head unit carries its own copy).
`load_tensors` reads only the named tensors from the model's source (shards.source; for a
directory `read_safetensors` reads them from `model.safetensors` or the shards listed in
`model.safetensors.index.json`), as float32: exporting one unit never needs the whole model
in memory. `materialize` fills the parameters of chosen submodules of a model built on the
"meta" device; `load_model` fills all of them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from shards.arch import CausalLM, build_model
from shards.config import WEIGHTS_FILE, WEIGHTS_INDEX, ModelConfig
from shards.errors import ModelError
from shards.source import ModelSource, open_model

# Per family: the checkpoint's prefix for the base model and for layer i, our module path ->
# its Hugging Face module path (top-level modules, then modules inside one layer).
_LLAMA_LAYER = {
    "attn.norm": "input_layernorm",
    "attn.q_proj": "self_attn.q_proj",
    "attn.k_proj": "self_attn.k_proj",
    "attn.v_proj": "self_attn.v_proj",
    "attn.o_proj": "self_attn.o_proj",
    "mlp.norm": "post_attention_layernorm",
    "mlp.gate_proj": "mlp.gate_proj",
    "mlp.up_proj": "mlp.up_proj",
    "mlp.down_proj": "mlp.down_proj",
}
_GPT2_LAYER = {
    "attn.norm": "ln_1",
    "attn.c_attn": "attn.c_attn",
    "attn.c_proj": "attn.c_proj",
    "mlp.norm": "ln_2",
    "mlp.c_fc": "mlp.c_fc",
    "mlp.c_proj": "mlp.c_proj",
}
_BLOOM_LAYER = {
    "attn.norm": "input_layernorm",
    "attn.query_key_value": "self_attention.query_key_value",
    "attn.dense": "self_attention.dense",
    "mlp.norm": "post_attention_layernorm",
    "mlp.dense_h_to_4h": "mlp.dense_h_to_4h",
    "mlp.dense_4h_to_h": "mlp.dense_4h_to_h",
}
_NAMES = {
    "llama": ("model.", "layers.", {"embed.tokens": "embed_tokens", "head.norm": "norm"},
              _LLAMA_LAYER),
    "gpt2": ("transformer.", "h.",
             {"embed.tokens": "wte", "embed.positions": "wpe", "head.norm": "ln_f"}, _GPT2_LAYER),
    "bloom": ("transformer.", "h.",
              {"embed.tokens": "word_embeddings", "embed.norm": "word_embeddings_layernorm",
               "head.norm": "ln_f"}, _BLOOM_LAYER),
}
# Older checkpoints (e.g. the original gpt2) store the base model without its prefix.
_OPTIONAL_PREFIXES = ("model.", "transformer.")


def param_sources(config: ModelConfig) -> dict[str, str]:
    """Our parameter name -> Hugging Face tensor name, for every parameter of the model."""
    return _sources(build_model(config, "meta"))


def _sources(model: CausalLM) -> dict[str, str]:
    sources = {}
    for name, _ in model.named_parameters(remove_duplicate=False):
        module, leaf = name.rsplit(".", 1)
        sources[name] = f"{_hf_module(model.config, module)}.{leaf}"
    return sources


def _hf_module(config: ModelConfig, module: str) -> str:
    base, layer_prefix, top, layer_names = _NAMES[config.family]
    if module == "head.lm_head":
        return base + top["embed.tokens"] if config.tie_embeddings else "lm_head"
    if module.startswith("layers."):
        _, index, inner = module.split(".", 2)
        return f"{base}{layer_prefix}{index}.{layer_names[inner]}"
    return base + top[module]


def load_tensors(
    model: str | Path | ModelSource, hf_names: Iterable[str]
) -> dict[str, torch.Tensor]:
    """Read just `hf_names` from the model, as float32 tensors keyed by those names."""
    return open_model(model).read_tensors(hf_names)


def read_safetensors(model_dir: str | Path, hf_names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Read just `hf_names` from a checkpoint directory's safetensors files."""
    model_dir = Path(model_dir)
    stored = _stored_tensors(model_dir)
    by_file: dict[Path, dict[str, str]] = {}
    for name in set(hf_names):
        key = _stored_name(name, stored)
        if key is None:
            raise ModelError(f"missing tensor {name} in {model_dir}")
        by_file.setdefault(model_dir / stored[key], {})[key] = name
    tensors = {}
    for path, names in by_file.items():
        try:
            with safe_open(str(path), framework="pt") as handle:
                for key, name in names.items():
                    tensors[name] = _as_float32(handle.get_tensor(key))
        except (OSError, RuntimeError, ValueError, SafetensorError) as exc:
            raise ModelError(f"unreadable weights {path}: {_one_line(exc)}") from None
    return tensors


def _stored_tensors(model_dir: Path) -> dict[str, str]:
    """Every tensor name in the checkpoint -> the file (relative to model_dir) holding it."""
    index = model_dir / WEIGHTS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelError(f"unreadable {WEIGHTS_INDEX} in {model_dir}: {exc!r}") from None
        return dict(weight_map)
    single = model_dir / WEIGHTS_FILE
    if not single.is_file():
        raise ModelError(f"no weights: expected {WEIGHTS_FILE} or {WEIGHTS_INDEX}")
    try:
        with safe_open(str(single), framework="pt") as handle:
            return dict.fromkeys(handle.keys(), WEIGHTS_FILE)
    except (OSError, RuntimeError, ValueError, SafetensorError) as exc:
        raise ModelError(f"unreadable weights {single}: {_one_line(exc)}") from None


def _stored_name(name: str, stored: dict[str, str]) -> str | None:
    if name in stored:
        return name
    for prefix in _OPTIONAL_PREFIXES:
        if name.startswith(prefix) and name[len(prefix):] in stored:
            return name[len(prefix):]
    return None


def _as_float32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() if tensor.is_floating_point() else tensor


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


def materialize(
    model: CausalLM, source: str | Path | ModelSource, module_prefixes: Iterable[str]
) -> None:
    """Load real weights from `source` for the parameters under `module_prefixes` (e.g.
    "layers.3.attn"; "" means all), replacing whatever they hold (typically meta tensors)."""
    prefixes = list(module_prefixes)
    sources = _sources(model)
    wanted = {ours: hf for ours, hf in sources.items() if _under(ours, prefixes)}
    for prefix in prefixes:
        if not any(_under(ours, [prefix]) for ours in wanted):
            raise ValueError(f"no parameters under {prefix!r}")
    tensors = load_tensors(source, wanted.values())
    for ours, hf in wanted.items():
        _assign(model, ours, hf, tensors[hf])


def _under(name: str, prefixes: list[str]) -> bool:
    return any(not p or name == p or name.startswith(p + ".") for p in prefixes)


def _assign(model: nn.Module, name: str, hf_name: str, tensor: torch.Tensor) -> None:
    module_name, leaf = name.rsplit(".", 1)
    module = model.get_submodule(module_name)
    expected = tuple(getattr(module, leaf).shape)
    if tuple(tensor.shape) != expected:
        raise ModelError(
            f"tensor {hf_name} has shape {tuple(tensor.shape)} but the config implies {expected}"
        )
    setattr(module, leaf, nn.Parameter(tensor, requires_grad=False))


def load_model(path: str | Path) -> tuple[ModelConfig, CausalLM]:
    """The config and the whole model with every weight loaded (float32, CPU)."""
    source = open_model(path)
    config = source.config()
    model = build_model(config, "meta")
    materialize(model, source, [""])
    return config, model
