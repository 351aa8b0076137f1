"""The last minute of every peer's figures, as the leader's reports carried them: what the
rebalancer saw, and what the dashboard draws."""

from __future__ import annotations

import collections
import time
from typing import Any

from peerd.wire.protocol import ClusterReport

KEEP = 60  # reports, about one a second


class FiguresHistory:
    def __init__(self, keep: int = KEEP) -> None:
        self._keep = keep
        self._by_peer: dict[str, collections.deque] = {}

    def add(self, report: ClusterReport, now: float | None = None) -> None:
        at = time.time() if now is None else now
        present = {f.id for f in report.peers}
        for peer in set(self._by_peer) - present:
            del self._by_peer[peer]
        for f in report.peers:
            entries = self._by_peer.setdefault(f.id, collections.deque(maxlen=self._keep))
            entries.append({
                "t": round(at, 3),
                "load": round(f.load, 4),
                "memory_available": f.memory_available,
                "battery": None if f.battery is None else
                {"percent": f.battery.percent, "plugged": f.battery.plugged},
                "stage_s": f.stage_s,
                "units": list(f.units),
            })

    def document(self) -> dict[str, list[dict[str, Any]]]:
        """`peerd status`'s `history`: per peer id, oldest first."""
        return {peer: list(entries) for peer, entries in sorted(self._by_peer.items())}
