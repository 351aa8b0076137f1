"""Small, randomly initialised Hugging Face checkpoints built on the spot for tests.

`make_checkpoint(tmp_path, family, **overrides)` builds a `transformers` model from a tiny
config, saves it with `save_pretrained(safe_serialization=True)` exactly as a real
checkpoint directory looks on disk (config.json, generation_config.json, model.safetensors
or a sharded index), and writes a real byte-level BPE `tokenizer.json` plus a
`tokenizer_config.json` whose jinja `chat_template` is ChatML-like. Nothing is downloaded.

Tokenizers (`tokenizer=`), named after llama.cpp's pre-tokenizer names, all trained here on a
small corpus, with `<s>` (BOS_ID), `</s>` (EOS_ID), `<|im_start|>` and `<|im_end|>` at the ids
below:
  True or "gpt-2"  byte-level BPE with GPT-2's split (the default);
  "llama-bpe"      byte-level BPE split like Llama 3 (its regex; merges ignored for whole words);
  "qwen2"          byte-level BPE split like Qwen2 (its regex, NFC), no BOS;
  "spm"            Llama 2's SentencePiece-style BPE: `▁` for spaces prepended by the
                   normaliser, `<0x00>`..`<0xFF>` byte fallback, `<unk>` at id 0 (PAD_ID).

Families: "llama" (GQA, untied), "llama-tied", "llama3-rope-scaling", "llama-rope-linear",
"qwen2" (qkv bias), "mistral" (sliding window smaller than the test sequences), "gpt2",
"bloom".

Overrides understood for every family:
  layers, hidden, heads, kv_heads (Llama family), intermediate, vocab_size, seed,
  dtype="float32"|"float16"|"bfloat16"  (dtype of the tensors on disk),
  max_shard_size="40KB"                 (a sharded checkpoint with an index),
  tokenizer=False                       (no tokenizer files at all; see above for the others),
  chat_template=None                    (tokenizer_config.json without a template).
Any other keyword goes straight into the family's `transformers` config constructor.

Weights use initializer_range=0.2 (ten times the usual) so that greedy decisions have clear
margins and are stable under float32 reordering.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers
from gguf_vocab import LLAMA3_SPLIT, QWEN2_SPLIT
from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from shards.builtin import BOS_TOKEN, SPECIAL_TOKENS, train_tokenizer, write_tokenizer_files

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
TOKENIZERS = ("gpt-2", "llama-bpe", "qwen2", "spm")  # llama.cpp's name for each kind
TOKENIZER_FAMILIES = {"gpt-2": "gpt2", "llama-bpe": "llama", "qwen2": "qwen2", "spm": "llama"}
_SPM_SPECIAL_TOKENS = ("<unk>", *SPECIAL_TOKENS[1:])  # Llama 2 has no pad token: <unk> at 0
_SPLITS = {"llama-bpe": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT}

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
_SPM_LEARNED_VOCAB = 100  # pieces learned beyond the special and byte tokens


def make_checkpoint(tmp_path: Path, family: str, **overrides: Any) -> Path:
    """Build and save one random checkpoint under `tmp_path`; return its directory."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")
    dtype = getattr(torch, overrides.pop("dtype", "float32"))
    max_shard_size = overrides.pop("max_shard_size", None)
    style = overrides.pop("tokenizer", True)
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
    if style:
        style = "gpt-2" if style is True else style
        add_bos = family != "gpt2" and style != "qwen2"
        write_tokenizer(out, style, add_bos=add_bos, chat_template=chat_template)
    return out


def write_tokenizer(out: Path, style: str, add_bos: bool, chat_template: str | None) -> None:
    """Write tokenizer.json and tokenizer_config.json of tokenizer `style` into `out`."""
    if style not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {style!r}; choose from {TOKENIZERS}")
    if style == "gpt-2":
        tokenizer = train_tokenizer(_CORPUS, vocab_size=_TOKENIZER_VOCAB, add_bos=add_bos)
    elif style == "spm":
        tokenizer = _sentencepiece_style_tokenizer()
    else:
        tokenizer = _split_byte_level_tokenizer(style)
    if style != "gpt-2":
        tokenizer.post_processor = _post_processor(tokenizer, add_bos)
    write_tokenizer_files(out, tokenizer, add_bos=add_bos, chat_template=chat_template)
    if style == "spm":
        config_path = out / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config.update(unk_token="<unk>", pad_token="<unk>")
        config_path.write_text(json.dumps(config, indent=1) + "\n")


def _split_byte_level_tokenizer(style: str) -> Tokenizer:
    """Byte-level BPE whose words are cut by the `style` model's regex, as in its own file."""
    tokenizer = Tokenizer(models.BPE(ignore_merges=style == "llama-bpe"))
    if style == "qwen2":
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLITS[style]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_TOKENIZER_VOCAB, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer=trainer)
    return tokenizer


def _sentencepiece_style_tokenizer() -> Tokenizer:
    """Llama 2's layout: special tokens, then `<0x00>`..`<0xFF>`, then the learned pieces
    (words start with `▁`, learned word by word as SentencePiece does)."""
    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always", split=True)
    learner.train_from_iterator(_CORPUS, trainer=trainers.BpeTrainer(
        vocab_size=_SPM_LEARNED_VOCAB, show_progress=False))
    learned = json.loads(learner.to_str())["model"]
    pieces = [*_SPM_SPECIAL_TOKENS, *(f"<0x{byte:02X}>" for byte in range(256)),
              *sorted(learned["vocab"], key=learned["vocab"].get)]
    tokenizer = Tokenizer(models.BPE(
        {piece: index for index, piece in enumerate(pieces)},
        [tuple(merge) for merge in learned["merges"]],
        unk_token="<unk>", fuse_unk=True, byte_fallback=True,
    ))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tokenizer.decoder = decoders.Sequence([
        decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0),
    ])
    tokenizer.add_special_tokens(list(_SPM_SPECIAL_TOKENS))
    return tokenizer


def _post_processor(tokenizer: Tokenizer, add_bos: bool) -> processors.PostProcessor | None:
    if not add_bos:
        return None
    bos = (BOS_TOKEN, tokenizer.token_to_id(BOS_TOKEN))
    return processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[bos])


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
