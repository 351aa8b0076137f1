"""How long each unit takes on this peer: the prices the leader's planner puts on its units.

A stage's units are timed one by one: by the warm-up step right after they load (deploy),
then by every decode step that runs them (the data plane), which also times what the stage
spends outside its units (its overhead: the step's inputs complete to its outputs sent or
its token sampled, less the units' time). Each unit, and the overhead, keeps its last
`WINDOW` samples and its figure is their median, so one step slowed by a passing hiccup
does not move it, while a lasting change (other work on the machine) does within a few
dozen tokens. The figures are for one model at a time (by manifest key); the times of
units this peer ran under an earlier plan stay, since they are still what the unit costs
here. They travel to the leader in this peer's figures (`PeerFigures.unit_times`).
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Mapping

from peerd.wire.protocol import UnitTimes

WINDOW = 32  # samples kept per unit


class UnitClock:
    def __init__(self, window: int = WINDOW) -> None:
        self.window = window
        self.model: str | None = None
        self._samples: dict[int, collections.deque[float]] = {}
        self._overhead: collections.deque[float] = collections.deque(maxlen=window)

    def record(self, model: str, unit_s: Mapping[int, float],
               overhead_s: float | None = None) -> None:
        """One run of some units of `model` (manifest key): seconds by unit index, and the
        stage's overhead when it was a real step."""
        if model != self.model:
            self.model, self._samples = model, {}
            self._overhead.clear()
        for unit, seconds in unit_s.items():
            if seconds > 0:
                self._samples.setdefault(
                    unit, collections.deque(maxlen=self.window)).append(seconds)
        if overhead_s is not None:
            self._overhead.append(max(overhead_s, 0.0))

    def figures(self) -> UnitTimes | None:
        """Each unit's median seconds; None before any unit ran."""
        if self.model is None or not self._samples:
            return None
        units = tuple(sorted(self._samples))
        overhead = statistics.median(self._overhead) if self._overhead else None
        return UnitTimes(self.model, units,
                         tuple(statistics.median(self._samples[u]) for u in units), overhead)
