"""The built-in demo model is a real, loadable Hugging Face checkpoint, made reproducibly,
and `peerd demo --write-model DIR` writes it for a user to start on real devices."""

import json

import torch
import transformers
from tokenizers import Tokenizer

from peerd.commands.cli import main
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


def test_demo_writes_the_model_for_peerd_start_and_transformers_loads_it(tmp_path, capsys):
    model_dir = tmp_path / "builtin"
    assert main(["demo", "--write-model", str(model_dir)]) == 0
    assert f"peerd start --model {model_dir}" in capsys.readouterr().out
    assert sorted(p.name for p in model_dir.iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hello!"}],
                                        add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 4)


def test_demo_writes_the_model_only_into_a_new_or_empty_directory(tmp_path, capsys):
    mine = tmp_path / "config.json"
    mine.write_text("mine")
    assert main(["demo", "--write-model", str(tmp_path)]) == 1
    error = capsys.readouterr().err
    assert error == f"peerd: {tmp_path} exists and is not an empty directory; name a new or " \
        "empty one\n"
    assert mine.read_text() == "mine"
