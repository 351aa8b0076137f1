"""Write a random Llama-format checkpoint of any size, one layer at a time.

Each layer goes into its own safetensors file listed in `model.safetensors.index.json`, so
writing never holds more than one layer (or the embedding) in memory. Weights are drawn like
a freshly initialised model (normal, std 0.02; norms at 1). No tokenizer is written: use
`--prompt-ids`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file


@dataclass(frozen=True)
class LlamaShape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int = 32000


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The shape of a bench's random Llama (24 layers, hidden 1024, by default)."""
    for flag, default in (("--layers", 24), ("--hidden", 1024), ("--intermediate", 2816),
                          ("--heads", 16), ("--kv-heads", 4)):
        parser.add_argument(flag, type=int, default=default)


def shape_from(args: argparse.Namespace) -> LlamaShape:
    return LlamaShape(args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads)


def reusable_llama(root: Path, shape: LlamaShape, note: Callable[[str], None]) -> Path:
    """The random Llama of `shape` under `root`, written unless an earlier run left it there
    (config.json is written last: its presence means the checkpoint is complete)."""
    model_dir = Path(root) / f"llama-{shape.layers}x{shape.hidden}"
    if not (model_dir / "config.json").exists():
        note(f"writing a random Llama checkpoint: {shape}")
        write_llama(model_dir, shape)
    return model_dir


def write_llama(directory: Path, shape: LlamaShape, dtype: str = "float32", seed: int = 0) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    groups = [_embedding(shape, rng), *(_layer(shape, i, rng) for i in range(shape.layers))]
    weight_map = {}
    for number, tensors in enumerate(groups):
        name = f"model-{number + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: v.astype(dtype) for k, v in tensors.items()}, str(directory / name))
        weight_map.update(dict.fromkeys(tensors, name))
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (directory / "config.json").write_text(json.dumps(_config(shape, dtype), indent=1))
    return directory


def _config(shape: LlamaShape, dtype: str) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": shape.vocab,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": dtype,
    }


def _normal(rng: np.random.Generator, *shape: int) -> np.ndarray:
    weights = rng.standard_normal(size=shape, dtype=np.float32)
    weights *= 0.02
    return weights


def _embedding(shape: LlamaShape, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "model.embed_tokens.weight": _normal(rng, shape.vocab, shape.hidden),
        "model.norm.weight": np.ones(shape.hidden, np.float32),
        "lm_head.weight": _normal(rng, shape.vocab, shape.hidden),
    }


def _layer(shape: LlamaShape, index: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    hidden, inner = shape.hidden, shape.intermediate
    kv = shape.kv_heads * hidden // shape.heads
    prefix = f"model.layers.{index}"
    return {
        f"{prefix}.input_layernorm.weight": np.ones(hidden, np.float32),
        f"{prefix}.post_attention_layernorm.weight": np.ones(hidden, np.float32),
        f"{prefix}.self_attn.q_proj.weight": _normal(rng, hidden, hidden),
        f"{prefix}.self_attn.k_proj.weight": _normal(rng, kv, hidden),
        f"{prefix}.self_attn.v_proj.weight": _normal(rng, kv, hidden),
        f"{prefix}.self_attn.o_proj.weight": _normal(rng, hidden, hidden),
        f"{prefix}.mlp.gate_proj.weight": _normal(rng, inner, hidden),
        f"{prefix}.mlp.up_proj.weight": _normal(rng, inner, hidden),
        f"{prefix}.mlp.down_proj.weight": _normal(rng, hidden, inner),
    }
