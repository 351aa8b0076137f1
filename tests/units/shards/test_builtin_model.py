"""The built-in demo model is a real, loadable Hugging Face checkpoint, made reproducibly."""

import json

import torch
import transformers
from tokenizers import Tokenizer

from shards.builtin import CHAT_TEMPLATE, write_builtin_model


def test_builtin_model_loads_in_transformers_and_generates(tmp_path):
    model_dir = write_builtin_model(tmp_path / "demo")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    config = json.loads((model_dir / "config.json").read_text())
    assert model.config.vocab_size == config["vocab_size"]
    out = model.generate(torch.tensor([[1, 10, 20]]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 7)


def test_builtin_tokenizer_round_trips_text_and_knows_the_chat_tokens(tmp_path):
    model_dir = write_builtin_model(tmp_path / "demo")
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = "Hello! The devices split the model."
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
    for special in ("<s>", "</s>", "<|im_start|>", "<|im_end|>"):
        assert tokenizer.token_to_id(special) is not None
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE


def test_builtin_model_is_the_same_bytes_every_time(tmp_path):
    first = write_builtin_model(tmp_path / "a")
    second = write_builtin_model(tmp_path / "b")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes()
