"""Live tokens/s and compute-latency sparklines of this peer's stage.

Every stage runs one step per token of every sequence, so the data plane's step counter in
successive status documents gives the tokens per second flowing through the cluster, and its
compute seconds per step give this stage's time per token. The counters restart with the data
plane when the plan changes; a falling counter starts the series over from there.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Label, Sparkline

HISTORY = 120


@dataclass(frozen=True)
class _Reading:
    at: float
    steps: int
    compute_s: float


class CounterRates:
    """Rates between successive readings of the data plane's counters."""

    def __init__(self, history: int = HISTORY):
        self.tokens_per_s: deque[float] = deque(maxlen=history)
        self.ms_per_token: deque[float] = deque(maxlen=history)
        self._last: _Reading | None = None

    def add(self, dataplane: dict[str, Any] | None, at: float) -> None:
        """Take the counters of a status document's `dataplane`, read at time `at` (s)."""
        if not dataplane or dataplane.get("steps") is None:
            self._last = None
            return
        reading = _Reading(at, dataplane["steps"], dataplane["compute_s"])
        last, self._last = self._last, reading
        if last is None or reading.steps < last.steps or reading.at <= last.at:
            return
        steps = reading.steps - last.steps
        self.tokens_per_s.append(steps / (reading.at - last.at))
        if steps:
            self.ms_per_token.append(1000 * (reading.compute_s - last.compute_s) / steps)

    @property
    def now(self) -> float | None:
        return self.tokens_per_s[-1] if self.tokens_per_s else None


class RateCharts(Vertical):
    """Two labelled sparklines; `show` redraws them from a CounterRates."""

    def compose(self) -> ComposeResult:
        yield Label("tokens/s through this peer", id="tokens-label")
        yield Sparkline([], id="tokens")
        yield Label("compute ms per token on this peer", id="latency-label")
        yield Sparkline([], id="latency")

    def show(self, rates: CounterRates) -> None:
        self.query_one("#tokens", Sparkline).data = list(rates.tokens_per_s)
        self.query_one("#latency", Sparkline).data = list(rates.ms_per_token)
        self.query_one("#tokens-label", Label).update(
            f"tokens/s through this peer: {_last(rates.tokens_per_s, '.1f')}"
        )
        self.query_one("#latency-label", Label).update(
            f"compute ms per token on this peer: {_last(rates.ms_per_token, '.2f')}"
        )


def _last(series: deque[float], spec: str) -> str:
    return format(series[-1], spec) if series else "-"
