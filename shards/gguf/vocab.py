"""The tokenizer of a GGUF file, rebuilt as a `tokenizers` Tokenizer from its metadata; no torch.

A GGUF holds no `tokenizer.json`. llama.cpp's converter stores the token list and what
llama.cpp's own tokenizers need under `tokenizer.ggml.*`; two kinds are rebuilt here:

- "gpt2", byte-level BPE (GPT-2, Llama 3, Qwen2): the tokens (spelt in the byte alphabet), the
  merges, and `pre`, llama.cpp's name for the regex that cuts text into words before BPE. Each
  name known here maps to that model's own pre-tokenizer (Qwen2 adds NFC, as its
  tokenizer.json does and llama.cpp does not; Llama 3 looks whole words up before merging, as
  both do); an unknown name is refused, because the wrong regex gives other ids without any
  error.
- "llama", SentencePiece BPE (Llama 2, Mistral): tokens and scores. The merges are recovered from
  the scores (SentencePiece merges the pair whose result scores highest, so a merge ranks by its
  result's score); `▁` stands for spaces and is prepended to each run of text between special
  tokens (llama.cpp's add_space_prefix, Llama 2's tokenizer.json); characters outside the
  vocabulary fall back to the `<0xNN>` byte tokens.

Control tokens (and the unknown token) become special added tokens, user-defined ones plain
added tokens, so both match whole in text. BOS/EOS are added per `add_bos_token` and
`add_eos_token`, defaulting as llama.cpp does. The chat template is `tokenizer.chat_template`;
the special token strings are the tokens at the bos/eos/unknown/padding ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import TokenType
from tokenizers import (
    AddedToken,
    Regex,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)
from tokenizers import Tokenizer as BackendTokenizer

from shards.errors import ModelError, NoTokenizer
from shards.gguf.metadata import read_metadata

_AS_IDS = "(give the prompt as token ids)"
_SPACE = "\u2581"

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _PreTokenizer:
    """How a byte-level BPE model cuts text into words; `split` None is GPT-2's own regex."""

    split: str | None
    nfc: bool = False
    ignore_merges: bool = False
    add_bos: bool = False  # llama.cpp's default where the file does not say


_GPT2 = _PreTokenizer(split=None)
_LLAMA3 = _PreTokenizer(_LLAMA3_SPLIT, ignore_merges=True, add_bos=True)
_QWEN2 = _PreTokenizer(_QWEN2_SPLIT, nfc=True)

# The names llama.cpp (llama-vocab.cpp) gives each of these three regexes
_PRE_TOKENIZERS = {
    **dict.fromkeys(("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es",
                     "jina-v2-de", "a.x-4.0", "mellum"), _GPT2),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2"), _LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "megrez"), _QWEN2),
}

_SPECIAL_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def read_tokenizer(path: str | Path) -> tuple[BackendTokenizer, str | None, dict[str, str]]:
    """The tokenizer of GGUF file `path`: the backend, the chat template and the special token
    strings ("bos_token" -> "<s>", ...); `NoTokenizer` if it has none that can be rebuilt."""
    meta = read_metadata(path)
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        raise NoTokenizer(f"no tokenizer: {path} has no tokenizer.ggml.model {_AS_IDS}")
    tokens = _list(meta, "tokenizer.ggml.tokens")
    types = meta.get("tokenizer.ggml.token_type", [TokenType.NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise ModelError(f"GGUF tokenizer of {path} has {len(types)} token types for "
                         f"{len(tokens)} tokens")
    if kind == "gpt2":
        pre = _pre_tokenizer(meta, path)
        backend, default_bos = _byte_level(meta, tokens, pre), pre.add_bos
    elif kind == "llama":
        backend, default_bos = _sentencepiece(meta, tokens, types), True
    else:
        raise NoTokenizer(f"GGUF tokenizer model {kind!r} of {path} is not supported: only "
                          f"'gpt2' and 'llama' are {_AS_IDS}")
    _add_special_tokens(backend, tokens, types)
    special = _special_tokens(meta, tokens)
    backend.post_processor = _bos_eos(meta, special, backend, default_bos)
    template = meta.get("tokenizer.chat_template")
    return backend, template, special


def _byte_level(meta: dict[str, Any], tokens: list[str], pre: _PreTokenizer) -> BackendTokenizer:
    merges = [_merge(text) for text in _list(meta, "tokenizer.ggml.merges")]
    backend = _bpe(tokens, merges, ignore_merges=pre.ignore_merges)
    if pre.nfc:
        backend.normalizer = normalizers.NFC()
    if pre.split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pre.split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    backend.decoder = decoders.ByteLevel()
    return backend


def _pre_tokenizer(meta: dict[str, Any], path: str | Path) -> _PreTokenizer:
    name = meta.get("tokenizer.ggml.pre", "default")
    try:
        return _PRE_TOKENIZERS[name]
    except KeyError:
        raise NoTokenizer(f"GGUF byte-level tokenizer of {path} has pre-tokenizer {name!r}, "
                          f"not one of llama.cpp's names for the GPT-2, Llama 3 or Qwen2 split "
                          f"{_AS_IDS}") from None


def _merge(text: str) -> tuple[str, str]:
    left, space, right = text.partition(" ")
    if not (space and left and right):
        raise ModelError(f"GGUF tokenizer merge {text!r} is not two tokens")
    return left, right


def _sentencepiece(meta: dict[str, Any], tokens: list[str], types: list[int]) -> BackendTokenizer:
    scores = _list(meta, "tokenizer.ggml.scores")
    if len(scores) != len(tokens):
        raise ModelError(f"GGUF tokenizer has {len(scores)} scores for {len(tokens)} tokens")
    unknown = _unknown_token(meta, tokens, types)
    backend = _bpe(tokens, _sentencepiece_merges(tokens, scores, types), unk_token=unknown,
                   fuse_unk=unknown is not None, byte_fallback=True)
    normalizer: list[normalizers.Normalizer] = [normalizers.Replace(" ", _SPACE)]
    decoder: list[decoders.Decoder] = [
        decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        normalizer.insert(0, normalizers.Prepend(_SPACE))
        decoder.append(decoders.Strip(" ", 1, 0))  # the prepended space
    backend.normalizer = normalizers.Sequence(normalizer)
    backend.decoder = decoders.Sequence(decoder)
    return backend


def _sentencepiece_merges(tokens: list[str], scores: list[float],
                          types: list[int]) -> list[tuple[str, str]]:
    """Every split of a normal piece into two normal pieces, best result score first (ties,
    rare as SentencePiece scores differ piece by piece, by the halves' ids)."""
    ids = {token: i for i, token in enumerate(tokens) if types[i] == TokenType.NORMAL}
    ranked = []
    for token, token_id in ids.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[token_id], ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _unknown_token(meta: dict[str, Any], tokens: list[str], types: list[int]) -> str | None:
    key = _SPECIAL_IDS["unk_token"]
    token_id = meta.get(key)
    if token_id is None:
        token_id = next((i for i, t in enumerate(types) if t == TokenType.UNKNOWN), None)
    return None if token_id is None else _token_at(tokens, token_id, key)


def _bpe(tokens: list[str], merges: list[tuple[str, str]], **options: Any) -> BackendTokenizer:
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    try:
        return BackendTokenizer(models.BPE(vocab, merges, **options))
    except Exception as exc:  # the Rust library raises plain Exception subclasses
        raise ModelError(f"GGUF tokenizer cannot be rebuilt: {exc}") from None


def _add_special_tokens(backend: BackendTokenizer, tokens: list[str], types: list[int]) -> None:
    """Control and unknown tokens as special tokens, user-defined ones as plain added tokens
    (both matched whole in the text, as llama.cpp does)."""
    typed = list(zip(tokens, types, strict=True))
    special = {TokenType.CONTROL, TokenType.UNKNOWN}
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind in typed if kind in special])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, kind in typed if kind == TokenType.USER_DEFINED])


def _special_tokens(meta: dict[str, Any], tokens: list[str]) -> dict[str, str]:
    special = {}
    for name, key in _SPECIAL_IDS.items():
        token_id = meta.get(key)
        if token_id is not None:
            special[name] = _token_at(tokens, token_id, key)
    return special


def _list(meta: dict[str, Any], key: str) -> list[Any]:
    if key not in meta:
        raise ModelError(f"GGUF file lacks metadata {key!r}")
    if not isinstance(meta[key], list):
        raise ModelError(f"GGUF metadata {key!r} is not a list")
    return meta[key]


def _token_at(tokens: list[str], token_id: int, key: str) -> str:
    if not 0 <= token_id < len(tokens):
        raise ModelError(f"GGUF {key} id {token_id} is outside the {len(tokens)} tokens")
    return tokens[token_id]


def _bos_eos(meta: dict[str, Any], special: dict[str, str], backend: BackendTokenizer,
             default_bos: bool) -> processors.PostProcessor | None:
    """BOS/EOS around each encoded text, as the file says or llama.cpp's default for it."""
    wanted = [
        name for name, key, default in (
            ("bos_token", "tokenizer.ggml.add_bos_token", default_bos),
            ("eos_token", "tokenizer.ggml.add_eos_token", False),
        ) if meta.get(key, default)
    ]
    missing = [name for name in wanted if name not in special]
    if missing:
        raise ModelError(f"GGUF tokenizer adds a {missing[0]} but names none")
    if not wanted:
        return None
    first = [special["bos_token"]] if "bos_token" in wanted else []
    last = [special["eos_token"]] if "eos_token" in wanted else []
    ids = [(t, backend.token_to_id(t)) for t in dict.fromkeys(first + last)]
    return processors.TemplateProcessing(
        single=" ".join([*first, "$A", *last]),
        pair=" ".join([*first, "$A", *last, *first, "$B", *last]),
        special_tokens=ids,
    )
