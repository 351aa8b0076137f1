"""A solve's time budget: when the exact phase must stop and hand back its best plan."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Deadline:
    at: float | None = None  # time.monotonic() when it passes; None: no limit

    @classmethod
    def after(cls, seconds: float | None) -> Deadline:
        return cls(None if seconds is None else time.monotonic() + seconds)

    def left(self) -> float | None:
        """Seconds left (never negative), None without a limit."""
        return None if self.at is None else max(self.at - time.monotonic(), 0.0)

    def passed(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at


class TimeUp(Exception):
    """The deadline passed before an exact method settled; the best plan found stands."""
