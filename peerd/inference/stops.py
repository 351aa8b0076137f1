"""Stop strings: an answer's text ends before the first one that appears in it.

Text arrives in pieces (one per token, see shards.text_stream.TextStream). A stop string may
straddle pieces, so the tail of the text that could still grow into one is held back until
it is decided: handed out once the next pieces show it is not a stop string, dropped with
everything after it once it is. Nothing handed out is ever taken back.
"""

from __future__ import annotations

from collections.abc import Iterable


class StopStrings:
    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = tuple(stops)
        if not all(self.stops):
            raise ValueError("a stop string must not be empty")
        self.text = ""  # handed out so far
        self.stopped = False  # a stop string appeared: nothing more is handed out
        self._held = ""  # text after `text` that may be the start of a stop string

    def add(self, piece: str) -> str:
        """The text that can be handed out now that `piece` follows what came before."""
        if self.stopped:
            return ""
        pending = self._held + piece
        found = [at for at in (pending.find(stop) for stop in self.stops) if at >= 0]
        if found:
            self.stopped, self._held = True, ""
            return self._hand_out(pending[: min(found)])
        held = self._undecided(pending)
        self._held = pending[len(pending) - held :] if held else ""
        return self._hand_out(pending[: len(pending) - held])

    def end(self) -> str:
        """The text held back, handed out as the answer ends without a stop string."""
        held, self._held = self._held, ""
        return self._hand_out(held)

    def _undecided(self, pending: str) -> int:
        """The length of the longest end of `pending` that begins a stop string."""
        longest = min(len(pending), max((len(stop) for stop in self.stops), default=1) - 1)
        for length in range(longest, 0, -1):
            tail = pending[-length:]
            if any(stop.startswith(tail) for stop in self.stops):
                return length
        return 0

    def _hand_out(self, text: str) -> str:
        self.text += text
        return text
