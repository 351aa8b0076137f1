"""The built-in default model: a small Llama-format checkpoint made on this machine.

Its weights are random (drawn from a fixed seed), so it produces gibberish. It exists so that
`peerd demo` and the README can show the whole path, from checkpoint to streamed answer,
without downloading anything. Point peerd at a real checkpoint directory for real answers.

The directory it writes is an ordinary Hugging Face checkpoint: `config.json`,
`model.safetensors`, `tokenizer.json` (a byte-level BPE trained here on the text below) and
`tokenizer_config.json` with a ChatML chat template. Torch-free: numpy and safetensors only.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
BOS_TOKEN, EOS_TOKEN = "<s>", "</s>"

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = """\
A household has several trusted devices: a desktop, a laptop, a mini PC and a tablet.
None of them can comfortably hold a useful language model alone, but together they can.
Each device runs a small daemon. The daemons find each other on the local network, elect a
leader, and the leader measures how fast every device computes and how quickly the links
between them carry data. It then splits the model into pieces and gives every device the
pieces it can run best. Hidden states flow from device to device around a ring, and the
answer streams back to whoever asked. When a laptop is unplugged or a desktop gets busy,
the work moves to the others while the answer keeps streaming.
Hello! How are you today? What is the weather like? Tell me a story about the sea.
The quick brown fox jumps over the lazy dog. One, two, three, four, five, six, seven.
"""

# Small enough to build in a second, large enough to be worth splitting over three peers.
DEMO_SHAPE = {
    "hidden_size": 256,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 704,
}


def train_tokenizer(
    corpus: Iterable[str] = _CORPUS.splitlines(), vocab_size: int = 1024, add_bos: bool = True
) -> Tokenizer:
    """A byte-level BPE tokenizer trained on `corpus`, with ChatML special tokens.

    With `add_bos`, encoding prepends `<s>` as Llama tokenizers do; without, it adds nothing
    (GPT-2 style).
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    if add_bos:
        bos_id = tokenizer.token_to_id(BOS_TOKEN)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A",
            pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
            special_tokens=[(BOS_TOKEN, bos_id)],
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def write_tokenizer_files(
    directory: Path,
    tokenizer: Tokenizer,
    add_bos: bool = True,
    chat_template: str | None = CHAT_TEMPLATE,
) -> None:
    """tokenizer.json plus a tokenizer_config.json (with the chat template, if any)."""
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": "<pad>",
        "add_bos_token": add_bos,
        "model_max_length": 2048,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")


def write_builtin_model(directory: Path, seed: int = 0) -> Path:
    """Write the built-in checkpoint into `directory` (created if needed) and return it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    write_tokenizer_files(directory, tokenizer)
    config = _llama_config(
        vocab_size=tokenizer.get_vocab_size(),
        bos_token_id=tokenizer.token_to_id(BOS_TOKEN),
        eos_token_id=tokenizer.token_to_id(EOS_TOKEN),
    )
    (directory / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    save_file(_llama_weights(config, seed), str(directory / "model.safetensors"))
    return directory


def _llama_config(vocab_size: int, bos_token_id: int | None, eos_token_id: int | None) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        **DEMO_SHAPE,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": "float32",
    }


def _llama_weights(config: dict, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim

    def normal(*shape: int) -> np.ndarray:
        return rng.normal(0.0, 0.02, size=shape).astype(np.float32)

    weights = {
        "model.embed_tokens.weight": normal(config["vocab_size"], hidden),
        "model.norm.weight": np.ones(hidden, dtype=np.float32),
        "lm_head.weight": normal(config["vocab_size"], hidden),
    }
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}"
        weights |= {
            f"{prefix}.input_layernorm.weight": np.ones(hidden, dtype=np.float32),
            f"{prefix}.post_attention_layernorm.weight": np.ones(hidden, dtype=np.float32),
            f"{prefix}.self_attn.q_proj.weight": normal(hidden, hidden),
            f"{prefix}.self_attn.k_proj.weight": normal(kv, hidden),
            f"{prefix}.self_attn.v_proj.weight": normal(kv, hidden),
            f"{prefix}.self_attn.o_proj.weight": normal(hidden, hidden),
            f"{prefix}.mlp.gate_proj.weight": normal(inter, hidden),
            f"{prefix}.mlp.up_proj.weight": normal(inter, hidden),
            f"{prefix}.mlp.down_proj.weight": normal(hidden, inter),
        }
    return weights
