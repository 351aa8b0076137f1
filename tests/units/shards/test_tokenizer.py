"""shards.tokenizer against transformers' own tokenizer on the same checkpoint files, and
TextStream's pieces against decoding every token, for each kind of tokenizer."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
import transformers
from checkpoints import BOS_ID, EOS_ID, IM_START_ID, TOKENIZER_FAMILIES, TOKENIZERS
from gguf_vocab import write_vocab_gguf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shards.errors import ModelError
from shards.text_stream import TextStream
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


@pytest.fixture(scope="module", params=[(kind, source) for kind in TOKENIZERS
                                        for source in ("dir", "gguf")], ids="-".join)
def any_tokenizer(request, hf_checkpoint, tmp_path_factory):
    """Each kind of tokenizer, from a checkpoint directory and rebuilt from a GGUF file."""
    kind, source = request.param
    family = TOKENIZER_FAMILIES[kind]
    model_dir = hf_checkpoint(family, tokenizer=kind)
    if source == "dir":
        return Tokenizer.from_dir(model_dir)
    path = tmp_path_factory.mktemp("gguf") / f"{kind}.gguf"
    return Tokenizer.from_gguf(write_vocab_gguf(path, family, vocab_of=model_dir))


CHARACTERS = st.characters(exclude_categories=("Cs",)) | st.sampled_from("日本語🙂👍🏽é ▁\n\t")
_BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")


def token_ids(tokenizer: Tokenizer) -> st.SearchStrategy[list[int]]:
    """Encoded texts, special tokens and single tokens of any kind, in any order. SentencePiece
    byte tokens come only as the bytes of whole characters in encoded text: a run of them that
    is not UTF-8 decodes to U+FFFD for every byte, characters the run completed earlier
    included, so no stream could hand such a character out before the run ends."""
    backend = tokenizer.backend
    singles = [i for i in range(backend.get_vocab_size())
               if not _BYTE_TOKEN.fullmatch(backend.id_to_token(i) or "")]
    segment = st.one_of(
        st.text(CHARACTERS, max_size=8).map(
            lambda text: tokenizer.encode(text, add_special_tokens=False)),
        st.sampled_from(sorted(backend.get_added_tokens_decoder())).map(lambda i: [i]),
        st.sampled_from(singles).map(lambda i: [i]),
    )
    return st.lists(segment, max_size=12).map(lambda segments: sum(segments, []))


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_stream_pieces_are_the_text_of_all_tokens_in_whole_characters(any_tokenizer, data):
    """After each token, the text handed out is the decode of every token so far, or, while
    that ends inside a character (in U+FFFD), what was handed out before."""
    ids = data.draw(token_ids(any_tokenizer))
    stream, expected = TextStream(any_tokenizer), ""
    for count, token in enumerate(ids, 1):
        before = stream.text
        piece = stream.add(token)
        whole = any_tokenizer.decode(ids[:count])
        if not whole.endswith("\ufffd"):
            expected = whole
        assert before + piece == stream.text == expected, (ids[:count], piece)
        assert not piece.endswith("\ufffd")


class CountingDecodes:
    """A tokenizer that counts the token ids it is given to decode."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids_decoded = 0

    def decode(self, ids: list[int]) -> str:
        self.ids_decoded += len(ids)
        return self.tokenizer.decode(ids)


def test_stream_work_per_token_is_constant(any_tokenizer):
    """A 2,000-token answer decodes a few ids per token (decoding the whole answer at every
    token would decode about 2,000,000)."""
    paragraph = "Héllo, naïve café: 日本語のテキスト 🙂👍🏽 and plain words, numbers 0 1 10 100.\n"
    ids = any_tokenizer.encode(paragraph * 200, add_special_tokens=False)[:2000]
    while any_tokenizer.decode(ids).endswith("\ufffd"):  # cut inside a character
        ids.pop()
    assert len(ids) > 1990
    counting = CountingDecodes(any_tokenizer)
    stream = TextStream(counting)
    pieces = [stream.add(token) for token in ids]
    assert counting.ids_decoded < 10 * len(ids)
    assert "".join(pieces) == stream.text == any_tokenizer.decode(ids)
