"""A checkpoint's tokenizer written into a GGUF file the way llama.cpp's converter writes it.

`add_vocab(writer, model_dir)` writes the `tokenizer.ggml.*` metadata and
`tokenizer.chat_template` that llama.cpp's convert_hf_to_gguf.py writes for the tokenizer of
`model_dir` (its `tokenizer.json`, `tokenizer_config.json` and `config.json`):

- byte-level BPE (GPT-2, Llama 3, Qwen2), as `_set_vocab_gpt2`: model "gpt2"; the vocabulary
  padded to config.json's `vocab_size` with `[PADn]` tokens (UNUSED); added tokens CONTROL
  when special or special-looking, else USER_DEFINED; the merges; `pre` naming the
  pre-tokenizer;
- SentencePiece-style BPE (byte_fallback, Llama 2), as `_set_vocab_sentencepiece`: model
  "llama", pre "default", a score and a type per token (`<unk>` UNKNOWN, added special tokens
  CONTROL, `<0xNN>` BYTE), padded with `[PADn]` (score -10000, UNUSED); no merges.

Special token ids, add_bos/add_eos and the chat template are written by gguf-py's own
`SpecialVocab`, the class the converter uses.

Two inputs of the converter are missing from test checkpoints, so they are derived instead:
- llama.cpp names `pre` by hashing the tokenizer's output on a fixed text, which only
  recognises published tokenizers; here the name comes from the pre-tokenizer's structure (its
  split regex and normaliser), which is what that hash stands for.
- SentencePiece scores come from `tokenizer.model`; here they are what a SentencePiece BPE
  model stores: minus the rank of the merge that makes a piece, single characters below every
  merge (in id order), 0 for `<unk>`, bytes and added tokens.

`write_vocab_gguf(path, arch, vocab_of=model_dir)` writes a GGUF file of that metadata and no
tensors. Stdlib and `gguf` only, so that it can be copied between worktrees on its own.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import gguf

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# (normaliser type, split regex; None: ByteLevel's own GPT-2 regex) -> llama.cpp's `pre` name
PRE_NAMES = {
    (None, None): "gpt-2",
    (None, LLAMA3_SPLIT): "llama-bpe",
    ("NFC", QWEN2_SPLIT): "qwen2",
}

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def add_vocab(writer: gguf.GGUFWriter, model_dir: Path) -> None:
    model_dir = Path(model_dir)
    tokenizer = _read_json(model_dir / "tokenizer.json")
    config = _read_json(model_dir / "config.json")
    if tokenizer["model"].get("byte_fallback"):
        count = _add_sentencepiece_vocab(writer, tokenizer, config)
        special_vocab = gguf.SpecialVocab(model_dir, n_vocab=count)
    else:
        _add_byte_level_vocab(writer, tokenizer, config)
        special_vocab = gguf.SpecialVocab(model_dir, load_merges=True)
    special_vocab.add_to_gguf(writer, quiet=True)


def write_vocab_gguf(path: Path, arch: str = "llama", vocab_of: Path | None = None,
                     **fields: Any) -> Path:
    """A GGUF with no tensors: `vocab_of`'s tokenizer as llama.cpp writes it, and/or
    tokenizer metadata given as keyword arguments (key without `tokenizer.ggml.`)."""
    writer = gguf.GGUFWriter(str(path), arch)
    if vocab_of is not None:
        add_vocab(writer, vocab_of)
    for key, value in fields.items():
        getattr(writer, f"add_{key}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def pre_name(tokenizer: dict[str, Any]) -> str:
    """llama.cpp's name for the pre-tokenizer of a byte-level BPE `tokenizer.json`."""
    pre = tokenizer.get("pre_tokenizer") or {}
    normalizer = (tokenizer.get("normalizer") or {}).get("type")
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        split = None
    else:
        splits = [p["pattern"].get("Regex") for p in pre.get("pretokenizers", [])
                  if p.get("type") == "Split"]
        split = splits[0] if len(splits) == 1 else "unrecognised"
    try:
        return PRE_NAMES[normalizer, split]
    except KeyError:
        raise ValueError(f"BPE pre-tokenizer was not recognized: {pre}") from None


def _add_byte_level_vocab(writer: gguf.GGUFWriter, tokenizer: dict, config: dict) -> None:
    by_id, added = _tokens_by_id(tokenizer), _added_by_id(tokenizer)
    tokens, types = [], []
    for token_id in range(_vocab_size(config, by_id)):
        token = by_id.get(token_id)
        if token is None:
            token, token_type = f"[PAD{token_id}]", gguf.TokenType.UNUSED
        elif token_id in added:
            if added[token_id]["special"] or _looks_special(token):
                token_type = gguf.TokenType.CONTROL
            else:
                token, token_type = token.replace("\u2581", " "), gguf.TokenType.USER_DEFINED
        else:
            token_type = gguf.TokenType.NORMAL
        tokens.append(token)
        types.append(token_type)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_name(tokenizer))
    writer.add_token_list(tokens)
    writer.add_token_types(types)


def _add_sentencepiece_vocab(writer: gguf.GGUFWriter, tokenizer: dict, config: dict) -> int:
    by_id, added = _tokens_by_id(tokenizer), _added_by_id(tokenizer)
    size = _vocab_size(config, by_id)
    tokens = [f"[PAD{i}]" for i in range(size)]
    scores = [-10000.0] * size
    types = [gguf.TokenType.UNUSED] * size
    piece_scores = _sentencepiece_scores(tokenizer["model"])
    unknown = tokenizer["model"].get("unk_token")
    for token_id, token in sorted(by_id.items()):
        if token_id >= size:
            break
        tokens[token_id], scores[token_id] = token, 0.0
        if token == unknown:
            types[token_id] = gguf.TokenType.UNKNOWN
        elif token_id in added:
            special = added[token_id]["special"] or _looks_special(token)
            types[token_id] = gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED
        elif _BYTE_TOKEN.fullmatch(token):
            types[token_id] = gguf.TokenType.BYTE
        else:
            types[token_id], scores[token_id] = gguf.TokenType.NORMAL, piece_scores[token]
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    return size


def _sentencepiece_scores(model: dict[str, Any]) -> dict[str, float]:
    merges = [m.split(" ") if isinstance(m, str) else m for m in model["merges"]]
    scores: dict[str, float] = {}
    for rank, (left, right) in enumerate(merges):
        scores.setdefault(left + right, -float(rank))
    singles = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])
               if t not in scores]
    for offset, token in enumerate(singles):
        scores[token] = -float(len(merges) + offset)
    return scores


def _tokens_by_id(tokenizer: dict[str, Any]) -> dict[int, str]:
    by_id = {token_id: token for token, token_id in tokenizer["model"]["vocab"].items()}
    by_id.update((entry["id"], entry["content"]) for entry in tokenizer.get("added_tokens", []))
    return by_id


def _vocab_size(config: dict[str, Any], by_id: dict[int, str]) -> int:
    """config.json's vocab_size (the embedding rows), which may exceed the tokenizer's."""
    return config.get("vocab_size") or len(by_id)


def _added_by_id(tokenizer: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {entry["id"]: entry for entry in tokenizer.get("added_tokens", [])}


def _looks_special(token: str) -> bool:
    """The converter's `does_token_look_special`: added tokens some models forget to mark."""
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
