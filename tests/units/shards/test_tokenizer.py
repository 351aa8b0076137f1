"""shards.tokenizer against transformers' own tokenizer on the same checkpoint files."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import transformers
from checkpoints import BOS_ID, EOS_ID, IM_START_ID

from shards.errors import ModelError
from shards.tokenizer import Tokenizer

TEXTS = ["hello world! how are you today?", "  numbers 0 1 2 3, tabs\tand\nnewlines ", "ünïcödé ✓"]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "hi there"},
    {"role": "user", "content": "how are you?"},
]


def hf_tokenizer(model_dir):
    return transformers.AutoTokenizer.from_pretrained(model_dir)


def with_template(src, tmp_path, template):
    model_dir = shutil.copytree(src, tmp_path / "model")
    config_path = model_dir / "tokenizer_config.json"
    settings = json.loads(config_path.read_text())
    settings["chat_template"] = template
    config_path.write_text(json.dumps(settings))
    return model_dir


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_encode_decode_round_trip_matches_transformers(hf_checkpoint, family):
    model_dir = hf_checkpoint(family)
    ours, theirs = Tokenizer.from_dir(model_dir), hf_tokenizer(model_dir)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text)
        assert (ids[0] == BOS_ID) == (family == "llama")
        assert ours.decode(ids) == text
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(
            text, add_special_tokens=False)


def test_special_token_ids(hf_checkpoint):
    tokenizer = Tokenizer.from_dir(hf_checkpoint("llama"))
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (BOS_ID, EOS_ID)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_like_transformers(hf_checkpoint, add_generation_prompt):
    model_dir = hf_checkpoint("llama")
    ours = Tokenizer.from_dir(model_dir).apply_chat_template(
        CONVERSATION, add_generation_prompt=add_generation_prompt)
    theirs = hf_tokenizer(model_dir).apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert ours.startswith("<s><|im_start|>system\nYou are terse.<|im_end|>\n")
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_template_features_render_like_transformers(hf_checkpoint, tmp_path):
    """Whitespace control, loop controls, tojson and the {% generation %} tag."""
    template = (
        "{% for m in messages %}\n"
        "  {% if m.role == 'system' %}{% continue %}{% endif %}\n"
        "  {{ m | tojson }}|{% generation %}{{ m.content | upper }}{% endgeneration %}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}{{ eos_token }}{% endif %}"
    )
    model_dir = with_template(hf_checkpoint("llama"), tmp_path, template)
    ours = Tokenizer.from_dir(model_dir).apply_chat_template(CONVERSATION)
    theirs = hf_tokenizer(model_dir).apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert "You are terse" not in ours and "HI THERE" in ours


def test_prompt_ids_use_the_chat_template(hf_checkpoint):
    model_dir = hf_checkpoint("llama")
    ids = Tokenizer.from_dir(model_dir).prompt_ids("hello")
    expected = hf_tokenizer(model_dir).apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True)["input_ids"]
    assert ids == expected
    assert ids[:2] == [BOS_ID, IM_START_ID] and ids.count(BOS_ID) == 1


def test_prompt_ids_without_a_template_encode_plain_text(hf_checkpoint):
    tokenizer = Tokenizer.from_dir(hf_checkpoint("gpt2", chat_template=None))
    assert tokenizer.chat_template is None
    assert tokenizer.prompt_ids("hello world") == tokenizer.encode("hello world")
    with pytest.raises(ModelError, match="^this model has no chat template$"):
        tokenizer.apply_chat_template(CONVERSATION)


def test_raise_exception_in_template_is_a_model_error(hf_checkpoint):
    tokenizer = Tokenizer.from_dir(hf_checkpoint("llama"))
    with pytest.raises(ModelError, match="^chat template failed: unknown role: tool$"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "42"}])


def test_template_runs_sandboxed(hf_checkpoint, tmp_path):
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    tokenizer = Tokenizer.from_dir(with_template(hf_checkpoint("llama"), tmp_path, escape))
    with pytest.raises(ModelError, match="^chat template failed: "):
        tokenizer.apply_chat_template(CONVERSATION)


def test_missing_tokenizer_is_a_clear_error(hf_checkpoint):
    model_dir = hf_checkpoint("llama", tokenizer=False)
    with pytest.raises(ModelError) as caught:
        Tokenizer.from_dir(model_dir)
    assert str(caught.value) == (
        f"no tokenizer: {model_dir} has no tokenizer.json (give the prompt as token ids)")


def test_tokenizer_does_not_import_torch(hf_checkpoint):
    code = (
        "import sys\n"
        "from shards.tokenizer import Tokenizer\n"
        f"tokenizer = Tokenizer.from_dir({str(hf_checkpoint('llama'))!r})\n"
        "assert tokenizer.decode(tokenizer.prompt_ids('hello')).endswith('assistant\\n')\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
