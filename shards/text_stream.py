"""An answer's text handed out token by token, in whole characters.

Apart from shards/tokenizer.py so that a daemon streams answers without importing the
tokenizer libraries (tokenizers and jinja2, 10 MB resident): only a peer that loads a
tokenizer imports them.
"""

from __future__ import annotations

from typing import Protocol


class Decoder(Protocol):
    """What a stream needs of a tokenizer (shards.tokenizer.Tokenizer)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class TextStream:
    """Text of the tokens so far, handed out in pieces as tokens arrive.

    A token may end in the middle of a multi-byte character; its piece is held back until
    the character is complete, so every piece is valid text, and `text` is what was handed
    out: an answer that ends inside a character ends before it, wherever it is read (the
    daemon's stream, `peerd chat --json`, `peerd generate`).

    Each token costs a decode of a few recent tokens, not of the whole answer. The window
    holds the tokens of the last piece (up to `_read`) and those that came since; the last
    piece's tokens are decoded again with the new ones because a token's text depends on
    its neighbours (SentencePiece drops the space of the first `▁` of a text; byte fallback
    decodes a run of byte tokens together), and the new piece is the window's text past
    theirs. The window moves on when a piece is handed out, so it grows only over tokens
    that add no text yet (inside a character, or skipped special tokens).
    """

    def __init__(self, tokenizer: Decoder | None) -> None:
        self._tokenizer = tokenizer
        self._window: list[int] = []
        self._read = 0  # self._window[:self._read] is text already handed out ...
        self._read_text = ""  # ... decoded on its own
        self.text = ""

    def add(self, token: int) -> str:
        if self._tokenizer is None:
            return ""
        self._window.append(token)
        window_text = self._tokenizer.decode(self._window)
        piece = window_text[len(self._read_text) :]
        if not piece or piece.endswith("\ufffd"):
            return ""
        self._window = self._window[self._read :]
        self._read = len(self._window)
        self._read_text = self._tokenizer.decode(self._window)
        self.text += piece
        return piece
