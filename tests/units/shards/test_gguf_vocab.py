"""A GGUF file's tokenizer (shards.gguf.vocab) against the checkpoint's own tokenizer.json.

Each checkpoint's tokenizer is written into a metadata-only GGUF the way llama.cpp's converter
writes it (tests/gguf_vocab.py); the tokenizer rebuilt from that file must give the ids,
text and chat prompts that `Tokenizer.from_dir` and transformers give from the directory.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import gguf
import pytest
import transformers
from checkpoints import TOKENIZER_FAMILIES, TOKENIZERS
from gguf_vocab import write_vocab_gguf

from peerd.commands import generate
from peerd.errors import PeerdError
from peerd.inference.serving import Serving
from shards.errors import ModelError, NoTokenizer
from shards.tokenizer import Tokenizer

TEXTS = [
    "hello world! how are you today?",
    "Héllo, naïve café: déjà vu. Ünïcödé ✓",
    "日本語のテキスト and 中文 mixed",
    "emoji 🙂👍🏽 and a flag 🇫🇷",
    " leading space",
    "trailing spaces  ",
    "multiple   spaces\tand\ttabs",
    "   ",
    "lines\nand\n\nnewlines\r\nhere\n",
    "<s>hello</s> <|im_start|>user\nhi<|im_end|>\n",
    "cafe\u0301 decomposed",
    "numbers 0 1 10 100 1234567 3.14",
    "don't I'LL we'Re THEY'VE",
    "",
]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "héllo  wörld 🙂"},
    {"role": "assistant", "content": " 日本 "},
    {"role": "user", "content": "how are you?\n"},
]


@pytest.fixture(scope="module", params=TOKENIZERS)
def kind(request, hf_checkpoint, tmp_path_factory):
    """(checkpoint directory, its GGUF) for each kind of tokenizer."""
    family = TOKENIZER_FAMILIES[request.param]
    model_dir = hf_checkpoint(family, tokenizer=request.param)
    path = tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf"
    return model_dir, write_vocab_gguf(path, family, vocab_of=model_dir)


def test_the_file_holds_the_kind_llama_cpp_writes(kind):
    model_dir, path = kind
    reader = gguf.GGUFReader(path)
    model = reader.fields["tokenizer.ggml.model"].contents()
    pre = reader.fields["tokenizer.ggml.pre"].contents()
    assert (model, pre) == (("llama", "default") if "spm" in path.name else ("gpt2", path.stem))
    assert ("tokenizer.ggml.merges" in reader.fields) == (model == "gpt2")
    assert ("tokenizer.ggml.scores" in reader.fields) == (model == "llama")


def test_ids_match_the_directory_and_transformers(kind):
    model_dir, path = kind
    ours, source = Tokenizer.from_model(path), Tokenizer.from_dir(model_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(model_dir)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == source.encode(text) == theirs.encode(text), text
        plain = ours.encode(text, add_special_tokens=False)
        assert plain == theirs.encode(text, add_special_tokens=False), text


def test_ids_decode_to_the_same_text(kind):
    model_dir, path = kind
    ours, source = Tokenizer.from_gguf(path), Tokenizer.from_dir(model_dir)
    for text in TEXTS:
        ids = source.encode(text)
        assert ours.decode(ids) == source.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=False) == source.decode(
            ids, skip_special_tokens=False), text
    assert ours.decode(ours.encode(TEXTS[1])) == TEXTS[1]


def test_byte_fallback_and_padding_tokens_keep_the_model_vocabulary(kind):
    """Characters outside a SentencePiece vocabulary become <0xNN> byte tokens; the GGUF
    vocabulary is padded to the model's embedding rows, as llama.cpp pads it."""
    model_dir, path = kind
    ours = Tokenizer.from_gguf(path)
    rows = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    assert ours.backend.get_vocab_size() == rows > Tokenizer.from_dir(
        model_dir).backend.get_vocab_size()
    if "spm" in path.name:
        pieces = ours.backend.encode("日").tokens
        assert pieces == ["<s>", "▁", "<0xE6>", "<0x97>", "<0xA5>"]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_as_from_the_directory(kind, add_generation_prompt):
    model_dir, path = kind
    ours, source = Tokenizer.from_model(path), Tokenizer.from_dir(model_dir)
    assert ours.special_tokens == source.special_tokens
    assert ours.chat_template == source.chat_template
    rendered = ours.apply_chat_template(CONVERSATION, add_generation_prompt)
    assert rendered == source.apply_chat_template(CONVERSATION, add_generation_prompt)
    assert ours.conversation_ids(CONVERSATION) == source.conversation_ids(CONVERSATION)
    assert ours.prompt_ids("héllo 🙂") == source.prompt_ids("héllo 🙂")
    assert ours.bos_token_id == source.bos_token_id and ours.eos_token_id == source.eos_token_id


def test_a_gguf_without_a_tokenizer_says_to_give_token_ids(tmp_path):
    path = write_vocab_gguf(tmp_path / "bare.gguf")
    with pytest.raises(NoTokenizer) as caught:
        Tokenizer.from_model(path)
    assert str(caught.value) == (
        f"no tokenizer: {path} has no tokenizer.ggml.model (give the prompt as token ids)")


def test_an_unsupported_tokenizer_model_says_to_give_token_ids(tmp_path):
    path = write_vocab_gguf(tmp_path / "bert.gguf", "bert", tokenizer_model="bert",
                      token_list=["[PAD]", "[UNK]", "a"], token_types=[3, 2, 1])
    with pytest.raises(NoTokenizer) as caught:
        Tokenizer.from_model(path)
    assert str(caught.value) == (
        f"GGUF tokenizer model 'bert' of {path} is not supported: only 'gpt2' and 'llama' "
        "are (give the prompt as token ids)")


@pytest.mark.parametrize("pre", ["default", "deepseek-llm", None])
def test_an_unknown_pre_tokenizer_is_refused(tmp_path, pre):
    """A byte-level vocabulary split with the wrong regex would give other ids silently."""
    fields = {"tokenizer_model": "gpt2", "token_list": ["a", "b", "ab"],
              "token_merges": ["a b"], "token_types": [1, 1, 1]}
    if pre is not None:
        fields["tokenizer_pre"] = pre
    path = write_vocab_gguf(tmp_path / "old.gguf", **fields)
    with pytest.raises(NoTokenizer) as caught:
        Tokenizer.from_gguf(path)
    assert str(caught.value) == (
        f"GGUF byte-level tokenizer of {path} has pre-tokenizer '{pre or 'default'}', not one "
        "of llama.cpp's names for the GPT-2, Llama 3 or Qwen2 split (give the prompt as token "
        "ids)")


def test_control_tokens_are_special_and_user_defined_ones_whole(tmp_path):
    path = write_vocab_gguf(tmp_path / "tiny.gguf", tokenizer_model="gpt2", tokenizer_pre="gpt-2",
                      token_list=["a", "b", "ab", "Ġ", "Ġab", "<|end|>", "<think>"],
                      token_merges=["a b", "Ġ ab"], token_types=[1, 1, 1, 1, 1, 3, 4],
                      eos_token_id=5)
    tokenizer = Tokenizer.from_gguf(path)
    ids = tokenizer.encode("ab<think> ab<|end|>")
    assert ids == [2, 6, 4, 5]
    assert tokenizer.decode(ids) == "ab<think> ab"
    assert tokenizer.special_tokens == {"eos_token": "<|end|>"} and tokenizer.chat_template is None


@pytest.mark.parametrize(("pre", "expected"), [("llama-bpe", [5]), ("gpt-2", [0, 3])])
def test_llama3_takes_a_word_in_the_vocabulary_whole(tmp_path, pre, expected):
    """llama.cpp (and Llama 3's tokenizer.json, ignore_merges) look a word up before merging:
    here merging "abc" gives a + bc, as "b c" ranks first and "a bc" is no merge."""
    path = write_vocab_gguf(tmp_path / "whole.gguf", tokenizer_model="gpt2", tokenizer_pre=pre,
                      token_list=["a", "b", "c", "bc", "ab", "abc"],
                      token_merges=["b c", "a b", "ab c"], add_bos_token=False)
    assert Tokenizer.from_gguf(path).encode("abc") == expected


@pytest.mark.parametrize(("fields", "message"), [
    ({"token_merges": ["ab"]}, "GGUF tokenizer merge 'ab' is not two tokens"),
    ({"token_merges": ["a c"]}, "GGUF tokenizer cannot be rebuilt: .*"),
    ({"token_merges": ["a b"], "token_types": [1]}, "GGUF tokenizer of .* has 1 token types "
                                                    "for 3 tokens"),
    ({"token_merges": ["a b"], "add_bos_token": True}, "GGUF tokenizer adds a bos_token but "
                                                       "names none"),
    ({"token_merges": ["a b"], "eos_token_id": 7}, "GGUF tokenizer.ggml.eos_token_id id 7 is "
                                                   "outside the 3 tokens"),
])
def test_a_malformed_vocabulary_is_a_one_line_error(tmp_path, fields, message):
    base = {"tokenizer_model": "gpt2", "tokenizer_pre": "gpt-2", "token_list": ["a", "b", "ab"]}
    path = write_vocab_gguf(tmp_path / "bad.gguf", **base, **fields)
    with pytest.raises(ModelError, match=f"^{message}$"):
        Tokenizer.from_gguf(path)


def test_a_sentencepiece_file_without_scores_is_an_error(tmp_path):
    path = write_vocab_gguf(tmp_path / "spm.gguf", tokenizer_model="llama",
                            token_list=["<unk>", "a"])
    with pytest.raises(ModelError, match="^GGUF file lacks metadata 'tokenizer.ggml.scores'$"):
        Tokenizer.from_gguf(path)


def test_generate_and_the_head_take_the_tokenizer_of_a_gguf(hf_checkpoint, tmp_path):
    model_dir = hf_checkpoint("llama", tokenizer="spm")
    path = write_vocab_gguf(tmp_path / "spm.gguf", vocab_of=model_dir)
    source = Tokenizer.from_dir(model_dir)
    prompt = generate._prompt_ids(argparse.Namespace(prompt_ids=None, prompt="héllo"), path)
    assert prompt == source.prompt_ids("héllo")
    assert generate._decode(path, prompt) == source.decode(prompt)
    head_tokenizer = Serving("a", None, path)._load_tokenizer()  # no transport needed
    assert head_tokenizer.conversation_ids(CONVERSATION) == source.conversation_ids(CONVERSATION)


def test_without_a_gguf_tokenizer_generate_and_the_head_take_ids(tmp_path):
    path = write_vocab_gguf(tmp_path / "bare.gguf")
    with pytest.raises(PeerdError, match="^no tokenizer: .* \\(give the prompt as token ids\\)$"):
        generate._prompt_ids(argparse.Namespace(prompt_ids=None, prompt="hi"), path)
    assert generate._prompt_ids(argparse.Namespace(prompt_ids=[1, 5], prompt=None), path) == [1, 5]
    assert generate._decode(path, [1, 5]) == ""
    assert Serving("a", None, path)._load_tokenizer() is None


def test_the_gguf_tokenizer_does_not_import_torch(hf_checkpoint, tmp_path):
    path = write_vocab_gguf(tmp_path / "spm.gguf", vocab_of=hf_checkpoint("llama", tokenizer="spm"))
    code = (
        "import sys\n"
        "from shards.tokenizer import Tokenizer\n"
        f"tokenizer = Tokenizer.from_model({str(path)!r})\n"
        "assert tokenizer.decode(tokenizer.prompt_ids('hello')).endswith('assistant\\n')\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
