"""The K/V of finished answers, kept for the next turn of their conversation.

A chat's next turn sends the whole conversation again: the last turn's prompt and answer,
then the new message. The stages still hold the K/V of what the last turn ran, so the head
keeps those sequences after they end, and a new answer whose prompt starts with the tokens of
one of them takes its K/V over (`SequenceFork`, then the kept sequence is dropped: the new
answer's K/V holds the same positions, and its own room in the plan's K/V reserve counts
them) and prefills only the rest.

`PrefixCache` is the head's record of them: which sequences are kept, the tokens their K/V
holds, which one a prompt takes over, and which to give up, least recently used first, when
they hold more K/V than the room they are given. Pure: the data plane does the forking and
dropping (peerd/inference/dataplane.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# A shorter common prefix is prefilled again: a fork costs a request to every stage
MIN_REUSE = 16


@dataclass(frozen=True)
class Reuse:
    """Start a new answer from `length` positions of kept sequence `seq_id`."""

    seq_id: str
    length: int


class PrefixCache:
    def __init__(self, most: int = 8) -> None:
        """Keep at most `most` sequences."""
        self.most = most
        self._kept: OrderedDict[str, tuple[int, ...]] = OrderedDict()  # oldest use first

    def keep(self, seq_id: str, tokens: Sequence[int]) -> list[str]:
        """Keep a sequence whose K/V holds `tokens`; the sequences given up to make room."""
        self._kept[seq_id] = tuple(tokens)
        return self._evict(lambda: len(self._kept) > self.most)

    def take(self, prompt: Sequence[int]) -> Reuse | None:
        """The kept sequence sharing the longest prefix with `prompt`, if one shares
        MIN_REUSE tokens, no longer kept: the prompt's answer takes its K/V over. At least
        the prompt's last token is left to run, whose logits give the first new token."""
        best = self._best(prompt)
        if best is not None:
            del self._kept[best.seq_id]
        return best

    def within(self, tokens: int, sparing: Sequence[int] = ()) -> list[str]:
        """Give up sequences, least recently used first, until the kept K/V holds at most
        `tokens` positions; the sequences given up. The one a prompt `sparing` would take
        over is neither given up nor counted: its positions are that answer's."""
        spared = self._best(sparing)
        keep = "" if spared is None else spared.seq_id
        return self._evict(lambda: self.tokens - len(self._kept.get(keep, ())) > tokens, keep)

    def _best(self, prompt: Sequence[int]) -> Reuse | None:
        best: Reuse | None = None
        for seq_id, tokens in self._kept.items():
            length = min(_common(tokens, prompt), len(prompt) - 1)
            if length >= MIN_REUSE and (best is None or length > best.length):
                best = Reuse(seq_id, length)
        return best

    def clear(self) -> list[str]:
        """Give up every kept sequence; their ids."""
        gone = list(self._kept)
        self._kept.clear()
        return gone

    @property
    def tokens(self) -> int:
        """Positions of K/V the kept sequences hold."""
        return sum(len(tokens) for tokens in self._kept.values())

    def __len__(self) -> int:
        return len(self._kept)

    def _evict(self, over: Callable[[], bool], spare: str = "") -> list[str]:
        """Give up sequences, least recently used first but never `spare`, while `over()`."""
        gone = []
        for seq_id in list(self._kept):
            if not over():
                break
            if seq_id != spare:
                del self._kept[seq_id]
                gone.append(seq_id)
        return gone


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    length = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        length += 1
    return length
