"""Small, randomly initialised Hugging Face checkpoints built on the spot for tests.

`make_checkpoint(tmp_path, family, **overrides)` builds a `transformers` model from a tiny
config, saves it with `save_pretrained(safe_serialization=True)` exactly as a real
checkpoint directory looks on disk (config.json, generation_config.json, model.safetensors
or a sharded index), and writes a real byte-level BPE `tokenizer.json` plus a
`tokenizer_config.json` whose jinja `chat_template` is ChatML-like. Nothing is downloaded.

Families: "llama" (GQA, untied), "llama-tied", "llama3-rope-scaling", "llama-rope-linear",
"qwen2" (qkv bias), "mistral" (sliding window smaller than the test sequences), "gpt2",
"bloom".

Overrides understood for every family:
  layers, hidden, heads, kv_heads (Llama family), intermediate, vocab_size, seed,
  dtype="float32"|"float16"|"bfloat16"  (dtype of the tensors on disk),
  max_shard_size="40KB"                 (a sharded checkpoint with an index),
  tokenizer=False                       (no tokenizer files at all),
  chat_template=None                    (tokenizer_config.json without a template).
Any other keyword goes straight into the family's `transformers` config constructor.

Weights use initializer_range=0.2 (ten times the usual) so that greedy decisions have clear
margins and are stable under float32 reordering.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from shards.builtin import SPECIAL_TOKENS, train_tokenizer, write_tokenizer_files

FAMILIES = (
    "llama",
    "llama-tied",
    "llama3-rope-scaling",
    "llama-rope-linear",
    "qwen2",
    "mistral",
    "gpt2",
    "bloom",
)

PAD_ID, BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a household has several trusted devices, a desktop, a laptop and a mini pc",
    "none of which can comfortably hold a useful language model alone",
    "peers find each other on the network and run inference together",
    "hello world! how are you today? I am fine, thank you.",
    "numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000",
]

_DEFAULT_VOCAB = 384
_TOKENIZER_VOCAB = 320


def make_checkpoint(tmp_path: Path, family: str, **overrides: Any) -> Path:
    """Build and save one random checkpoint under `tmp_path`; return its directory."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")
    dtype = getattr(torch, overrides.pop("dtype", "float32"))
    max_shard_size = overrides.pop("max_shard_size", None)
    with_tokenizer = overrides.pop("tokenizer", True)
    chat_template = overrides.pop("chat_template", CHAT_TEMPLATE)
    torch.manual_seed(overrides.pop("seed", 0))
    transformers.utils.logging.disable_progress_bar()

    config = _hf_config(family, overrides)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    out = Path(tmp_path) / _dir_name(family, dtype, max_shard_size)
    save_kwargs = {"safe_serialization": True}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.to(dtype).save_pretrained(out, **save_kwargs)
    if with_tokenizer:
        write_tokenizer(out, add_bos=family != "gpt2", chat_template=chat_template)
    return out


def write_tokenizer(out: Path, add_bos: bool, chat_template: str | None) -> None:
    """Write tokenizer.json (byte-level BPE) and tokenizer_config.json into `out`."""
    tokenizer = train_tokenizer(_CORPUS, vocab_size=_TOKENIZER_VOCAB, add_bos=add_bos)
    write_tokenizer_files(out, tokenizer, add_bos=add_bos, chat_template=chat_template)


def _dir_name(family: str, dtype: torch.dtype, max_shard_size: str | None) -> str:
    name = f"{family}-{str(dtype).removeprefix('torch.')}"
    return f"{name}-sharded" if max_shard_size else name


def _hf_config(family: str, overrides: dict[str, Any]) -> transformers.PretrainedConfig:
    layers = overrides.pop("layers", 2)
    hidden = overrides.pop("hidden", 64)
    heads = overrides.pop("heads", 4)
    intermediate = overrides.pop("intermediate", 2 * hidden)
    common = {
        "vocab_size": overrides.pop("vocab_size", _DEFAULT_VOCAB),
        "initializer_range": 0.2,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
    }
    if family == "gpt2":
        kwargs = {"n_layer": layers, "n_embd": hidden, "n_head": heads,
                  "n_inner": intermediate, "n_positions": 256}
        return transformers.GPT2Config(**{**common, **kwargs, **overrides})
    if family == "bloom":
        kwargs = {"n_layer": layers, "hidden_size": hidden, "n_head": heads}
        return transformers.BloomConfig(**{**common, **kwargs, **overrides})
    kwargs = {
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": overrides.pop("kv_heads", heads // 2),
        "intermediate_size": intermediate,
        "max_position_embeddings": 256,
        **_LLAMA_FAMILY_EXTRAS[family],
    }
    config_class = {"qwen2": transformers.Qwen2Config, "mistral": transformers.MistralConfig}
    return config_class.get(family, transformers.LlamaConfig)(**{**common, **kwargs, **overrides})


_LLAMA_FAMILY_EXTRAS: dict[str, dict[str, Any]] = {
    "llama": {},
    "llama-tied": {"tie_word_embeddings": True},
    "llama3-rope-scaling": {
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
    },
    "llama-rope-linear": {
        "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
    },
    "qwen2": {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
    "mistral": {"sliding_window": 12},
}
