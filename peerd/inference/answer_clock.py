"""What the head's answers measure on one plan, beside what the planner predicted for it.

Two figures, from the last `WINDOW` decoded tokens (an answer's first token on a plane —
its prefill, or the step after its K/V moved there — is not a decode token and starts no
interval):

- latency: the median time between two tokens of an answer running alone, the measured
  counterpart of the plan's predicted per-token latency;
- throughput: decode tokens per second while answering, any number of answers at once (the
  time with no answer running does not count). With one answer at a time it is about
  1 / latency; the plan's predicted throughput is reached only with enough answers at once
  to keep every stage busy.
"""

from __future__ import annotations

import collections
import statistics

from peerd.wire.protocol import AnswerFigures

WINDOW = 256  # decode tokens


class AnswerClock:
    def __init__(self, window: int = WINDOW) -> None:
        self._alone: collections.deque[float] = collections.deque(maxlen=window)
        self._gaps: collections.deque[float] = collections.deque(maxlen=window)
        self._last = 0.0
        self.tokens = 0

    def begin(self, now: float, idle: bool) -> None:
        """An answer starts on the plane; `idle`: none was running, so no time was busy."""
        if idle:
            self._last = now

    def token(self, now: float, interval: float | None, alone: bool) -> None:
        """A token arrived at `now`, `interval` after the answer's previous one on this plane
        (None for its first)."""
        gap, self._last = now - self._last, now
        if interval is None:
            return
        self.tokens += 1
        self._gaps.append(gap)
        if alone and interval > 0:  # tokens of one clock tick say nothing of the latency
            self._alone.append(interval)

    def figures(self, plan: str) -> AnswerFigures:
        busy = sum(self._gaps)
        return AnswerFigures(
            plan=plan,
            latency_s=statistics.median(self._alone) if self._alone else None,
            throughput_tps=len(self._gaps) / busy if busy > 0 else None,
            tokens=self.tokens,
        )
