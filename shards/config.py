"""What peerd needs to know about a model, read from a Hugging Face `config.json`.

`load_config(path)` reads any model source (shards.source: a checkpoint directory or a GGUF
file). For a directory, `read_checkpoint_config` checks that it is a usable checkpoint
(config.json, safetensors weights, a supported architecture) and normalises the
family-specific key names and the two on-disk RoPE formats (transformers 4.x `rope_theta` +
`rope_scaling`, 5.x `rope_parameters`) into one `ModelConfig`. It does not import torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shards.errors import ModelError

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"

# Hugging Face class name -> the architecture family implemented in shards.arch.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "GPT2LMHeadModel": "gpt2",
    "BloomForCausalLM": "bloom",
}
ROPE_TYPES = ("default", "linear", "dynamic", "llama3")

_MISSING = object()


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of one causal LM; every field the architectures read."""

    architecture: str  # Hugging Face class name, e.g. "LlamaForCausalLM"
    family: str  # "llama" | "gpt2" | "bloom"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    max_positions: int
    activation: str  # Hugging Face activation name, e.g. "silu", "gelu_new"
    tie_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    rope_theta: float = 10000.0
    # None for plain RoPE, else {"rope_type": "linear"|"dynamic"|"llama3", "factor": ..., ...}
    # or, from a GGUF file, {"rope_type": "freq_factors", "factors": (one divisor per frequency)}
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    # One entry per layer: the sliding attention window, None for full attention.
    layer_windows: tuple[int | None, ...] = ()
    # GPT-2: scale scores by 1/sqrt(head_dim) (scale_attn_weights) and by 1/(layer+1).
    scale_attn_weights: bool = True
    scale_attn_by_layer: bool = False
    # BLOOM: the residual branch starts from the layer-norm output, not its input.
    residual_post_norm: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str = "float32"  # dtype of the weights on disk

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer`, or None for full causal attention."""
        return self.layer_windows[layer] if self.layer_windows else None


def load_config(path: str | Path) -> ModelConfig:
    """Read and validate the model at `path`; raise ModelError with a one-line reason if
    it is unusable."""
    from shards.source import open_model  # not at the top: shards.source imports this module

    return open_model(path).config()


def read_checkpoint_config(model_dir: str | Path) -> ModelConfig:
    """Read and validate the checkpoint directory `model_dir`."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ModelError(f"not a model directory: no config.json in {model_dir}")
    raw = _read_json(config_path)
    architecture = _architecture(raw)
    if not ((model_dir / WEIGHTS_FILE).is_file() or (model_dir / WEIGHTS_INDEX).is_file()):
        raise ModelError(f"no weights: expected {WEIGHTS_FILE} or {WEIGHTS_INDEX}")
    generation = model_dir / "generation_config.json"
    eos_source = _read_json(generation) if generation.is_file() else {}
    if eos_source.get("eos_token_id") is None:
        eos_source = raw
    common = {
        "architecture": architecture,
        "family": ARCHITECTURES[architecture],
        "vocab_size": _int(raw, "vocab_size"),
        "eos_token_ids": _ids(eos_source.get("eos_token_id")),
        "bos_token_id": raw.get("bos_token_id"),
        "torch_dtype": str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
    }
    family_fields = {"llama": _llama_fields, "gpt2": _gpt2_fields, "bloom": _bloom_fields}
    return ModelConfig(**common, **family_fields[common["family"]](raw))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(f"unreadable {path.name} in {path.parent}: {exc}") from None
    if not isinstance(data, dict):
        raise ModelError(f"unreadable {path.name} in {path.parent}: not a JSON object")
    return data


def _architecture(raw: dict[str, Any]) -> str:
    names = raw.get("architectures") or []
    if not names:
        raise ModelError("unsupported architecture: config.json names none")
    if names[0] not in ARCHITECTURES:
        raise ModelError(f"unsupported architecture: {names[0]}")
    return names[0]


def _get(raw: dict[str, Any], *keys: str, default: Any = _MISSING) -> Any:
    """The first of `keys` present (Hugging Face renamed several keys over the years)."""
    for key in keys:
        if raw.get(key) is not None:
            return raw[key]
    if default is _MISSING:
        raise ModelError(f"bad config.json: missing {keys[0]!r}")
    return default


def _int(raw: dict[str, Any], *keys: str, default: Any = _MISSING) -> int:
    value = _get(raw, *keys, default=default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelError(f"bad config.json: {keys[0]!r} must be a positive integer, got {value!r}")
    return value


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def _llama_fields(raw: dict[str, Any]) -> dict[str, Any]:
    hidden = _int(raw, "hidden_size")
    heads = _int(raw, "num_attention_heads")
    layers = _int(raw, "num_hidden_layers")
    is_qwen2 = raw["architectures"][0] == "Qwen2ForCausalLM"
    attention_bias = bool(raw.get("attention_bias", False))
    theta, scaling = _rope(raw)
    return {
        "hidden_size": hidden,
        "num_layers": layers,
        "num_heads": heads,
        "num_kv_heads": _int(raw, "num_key_value_heads", default=heads),
        "head_dim": _int(raw, "head_dim", default=hidden // heads),
        "intermediate_size": _int(raw, "intermediate_size"),
        "norm_eps": float(_get(raw, "rms_norm_eps", default=1e-6)),
        "max_positions": _int(raw, "max_position_embeddings", default=2048),
        "activation": str(_get(raw, "hidden_act", default="silu")),
        "tie_embeddings": bool(raw.get("tie_word_embeddings", False)),
        "qkv_bias": is_qwen2 or attention_bias,
        "o_bias": attention_bias and not is_qwen2,
        "mlp_bias": bool(raw.get("mlp_bias", False)),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "layer_windows": _layer_windows(raw, layers, is_qwen2),
    }


def _layer_windows(raw: dict[str, Any], layers: int, is_qwen2: bool) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    if window is None or (is_qwen2 and not raw.get("use_sliding_window", False)):
        return ()
    types = raw.get("layer_types")
    if types is None and is_qwen2:
        first_sliding = raw.get("max_window_layers", layers)
        return tuple(window if i >= first_sliding else None for i in range(layers))
    if types is None:
        return (window,) * layers
    return tuple(window if kind == "sliding_attention" else None for kind in types)


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ModelError(f"unsupported rope scaling: {rope_type}")
    if rope_type == "default":
        return theta, None
    required = {"linear": ["factor"], "dynamic": ["factor"],
                "llama3": ["factor", "low_freq_factor", "high_freq_factor",
                           "original_max_position_embeddings"]}[rope_type]
    for key in required:
        if key not in params:
            raise ModelError(f"bad config.json: {rope_type} rope scaling needs {key!r}")
    return theta, {"rope_type": rope_type, **{key: params[key] for key in required}}


def _gpt2_fields(raw: dict[str, Any]) -> dict[str, Any]:
    hidden = _int(raw, "n_embd", "hidden_size")
    heads = _int(raw, "n_head", "num_attention_heads")
    return {
        "hidden_size": hidden,
        "num_layers": _int(raw, "n_layer", "num_hidden_layers"),
        "num_heads": heads,
        "num_kv_heads": heads,
        "head_dim": hidden // heads,
        "intermediate_size": _int(raw, "n_inner", default=4 * hidden),
        "norm_eps": float(_get(raw, "layer_norm_epsilon", default=1e-5)),
        "max_positions": _int(raw, "n_positions", "max_position_embeddings"),
        "activation": str(_get(raw, "activation_function", default="gelu_new")),
        "tie_embeddings": bool(raw.get("tie_word_embeddings", True)),
        "qkv_bias": True,
        "o_bias": True,
        "mlp_bias": True,
        "scale_attn_weights": bool(raw.get("scale_attn_weights", True)),
        "scale_attn_by_layer": bool(raw.get("scale_attn_by_inverse_layer_idx", False)),
    }


def _bloom_fields(raw: dict[str, Any]) -> dict[str, Any]:
    hidden = _int(raw, "hidden_size", "n_embed")
    heads = _int(raw, "n_head", "num_attention_heads")
    return {
        "hidden_size": hidden,
        "num_layers": _int(raw, "n_layer", "num_hidden_layers"),
        "num_heads": heads,
        "num_kv_heads": heads,
        "head_dim": hidden // heads,
        "intermediate_size": 4 * hidden,
        "norm_eps": float(_get(raw, "layer_norm_epsilon", default=1e-5)),
        # ALiBi has no learned limit; BLOOM was trained on 2048-token sequences.
        "max_positions": _int(raw, "seq_length", default=2048),
        "activation": "bloom_gelu",
        "tie_embeddings": bool(raw.get("tie_word_embeddings", True)),
        "qkv_bias": True,
        "o_bias": True,
        "mlp_bias": True,
        "residual_post_norm": bool(raw.get("apply_residual_connection_post_layernorm", False)),
    }
