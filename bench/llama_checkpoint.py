"""Write a random Llama-format (or Qwen2-format) checkpoint of any size, one layer at a time.

Each layer goes into its own safetensors file listed in `model.safetensors.index.json`, so
writing never holds more than one layer (or the embedding) in memory; each tensor is cast to
the dtype on disk (float32, float16 or bfloat16) as it is drawn. Weights are drawn like a
freshly initialised model (normal, std 0.02; norms at 1); a Qwen2 shape adds the q/k/v biases
Qwen2 has, drawn the same way so that they matter. No tokenizer is written: use `--prompt-ids`.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class LlamaShape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int = 32000
    qwen2: bool = False  # Qwen2ForCausalLM: q/k/v biases, Qwen2's RoPE base and norm epsilon


BENCH_SHAPE = LlamaShape(layers=24, hidden=1024, intermediate=2816, heads=16, kv_heads=4)


def add_shape_arguments(parser: argparse.ArgumentParser, default: LlamaShape = BENCH_SHAPE) -> None:
    """The shape of a bench's random Llama (`default`: 24 layers, hidden 1024)."""
    for flag in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab"):
        parser.add_argument(f"--{flag.replace('_', '-')}", type=int, default=getattr(default, flag))


def shape_from(args: argparse.Namespace, qwen2: bool = False) -> LlamaShape:
    return LlamaShape(args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads,
                      args.vocab, qwen2)


def reusable_llama(root: Path, shape: LlamaShape, note: Callable[[str], None],
                   dtype: str = "float32") -> Path:
    """The random checkpoint of `shape` under `root`, written unless an earlier run left it
    there (config.json is written last: its presence means the checkpoint is complete)."""
    name = f"{'qwen2' if shape.qwen2 else 'llama'}-{shape.layers}x{shape.hidden}"
    name += "" if shape.vocab == BENCH_SHAPE.vocab else f"-vocab{shape.vocab}"
    model_dir = Path(root) / (name if dtype == "float32" else f"{name}-{dtype}")
    if not (model_dir / "config.json").exists():
        note(f"writing a random checkpoint: {shape}, {dtype} on disk")
        write_llama(model_dir, shape, dtype)
    return model_dir


def write_llama(directory: Path, shape: LlamaShape, dtype: str = "float32", seed: int = 0) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    cast = functools.partial(_cast, dtype=DTYPES[dtype])
    weight_map = {}
    for number, tensors in enumerate(_groups(shape, rng, cast), start=1):
        name = f"model-{number:05d}-of-{shape.layers + 1:05d}.safetensors"
        save_file(tensors, str(directory / name))
        weight_map.update(dict.fromkeys(tensors, name))
        del tensors  # before the next group is drawn
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (directory / "config.json").write_text(json.dumps(_config(shape, dtype), indent=1))
    return directory


def _config(shape: LlamaShape, dtype: str) -> dict:
    config = {
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
    if shape.qwen2:  # as Qwen2.5's own config.json says
        config |= {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                   "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "use_sliding_window": False,
                   "sliding_window": None, "max_window_layers": shape.layers,
                   "bos_token_id": 151643, "eos_token_id": 151643}
    return config


def _cast(weights: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(weights).to(dtype)


def _normal(rng: np.random.Generator, *shape: int) -> np.ndarray:
    weights = rng.standard_normal(size=shape, dtype=np.float32)
    weights *= 0.02
    return weights


Cast = Callable[[np.ndarray], torch.Tensor]


def _groups(shape: LlamaShape, rng: np.random.Generator, cast: Cast):
    """The tensors of each file, drawn one file at a time."""
    yield _embedding(shape, rng, cast)
    for index in range(shape.layers):
        yield _layer(shape, index, rng, cast)


def _embedding(shape: LlamaShape, rng: np.random.Generator, cast: Cast) -> dict[str, torch.Tensor]:
    return {
        "model.embed_tokens.weight": cast(_normal(rng, shape.vocab, shape.hidden)),
        "model.norm.weight": cast(np.ones(shape.hidden, np.float32)),
        "lm_head.weight": cast(_normal(rng, shape.vocab, shape.hidden)),
    }


def _layer(shape: LlamaShape, index: int, rng: np.random.Generator,
           cast: Cast) -> dict[str, torch.Tensor]:
    hidden, inner = shape.hidden, shape.intermediate
    kv = shape.kv_heads * hidden // shape.heads
    prefix = f"model.layers.{index}"
    tensors = {
        f"{prefix}.input_layernorm.weight": cast(np.ones(hidden, np.float32)),
        f"{prefix}.post_attention_layernorm.weight": cast(np.ones(hidden, np.float32)),
        f"{prefix}.self_attn.q_proj.weight": cast(_normal(rng, hidden, hidden)),
        f"{prefix}.self_attn.k_proj.weight": cast(_normal(rng, kv, hidden)),
        f"{prefix}.self_attn.v_proj.weight": cast(_normal(rng, kv, hidden)),
        f"{prefix}.self_attn.o_proj.weight": cast(_normal(rng, hidden, hidden)),
        f"{prefix}.mlp.gate_proj.weight": cast(_normal(rng, inner, hidden)),
        f"{prefix}.mlp.up_proj.weight": cast(_normal(rng, inner, hidden)),
        f"{prefix}.mlp.down_proj.weight": cast(_normal(rng, hidden, inner)),
    }
    if shape.qwen2:
        for name, width in (("q_proj", hidden), ("k_proj", kv), ("v_proj", kv)):
            tensors[f"{prefix}.self_attn.{name}.bias"] = cast(_normal(rng, width))
    return tensors
