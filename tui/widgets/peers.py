"""The peers table: one row per peer of the status document, with its measured figures,
the memory its units and their K/V occupy against its budget, the units the plan assigns it
and what its stage cost per token in the last answer.

The table is as wide as its pane, never wider: where every column does not fit, the least
needed go (the address first, then battery, load, GFLOP/s, role, ms/token) until the rest do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.cells import cell_len
from textual.widgets import DataTable

from tui.figures import size, span


@dataclass(frozen=True)
class Column:
    key: str
    label: str
    drop: int  # where the width is short, the highest go first; 0: always shown


COLUMNS = (
    Column("name", "name", 0), Column("address", "address", 6), Column("role", "role", 2),
    Column("state", "state", 0), Column("flops", "GFLOP/s", 3),
    Column("memory", "used / budget", 0), Column("load", "load", 4),
    Column("battery", "battery", 5), Column("units", "units", 0), Column("ms", "ms/token", 1),
)

Row = dict[str, str]  # cells by column key


def peer_rows(status: dict[str, Any], stage_ms: dict[str, float]) -> list[Row]:
    """The table's cells, one row per peer; `stage_ms` is compute ms per token by peer id."""
    plan = status.get("plan") or {}
    assigned = {s["peer"]: s["units"] for s in plan.get("stages", [])}
    return [_row(peer, status["leader"], assigned.get(peer["id"], []), stage_ms.get(peer["id"]))
            for peer in status["peers"]]


def _row(peer: dict[str, Any], leader: str | None, units: list[int], ms: float | None) -> Row:
    return {
        "name": peer["name"] + (" *" if peer["self"] else ""),
        "address": peer["address"],
        "role": "leader" if peer["id"] == leader else "follower",
        "state": peer["state"] + (" DUPLICATE" if peer["duplicate"] else ""),
        "flops": "-" if peer["flops"] is None else f"{peer['flops'] / 1e9:.1f}",
        "memory": memory(peer),
        "load": "-" if peer["load"] is None else f"{peer['load']:.0%}",
        "battery": _battery(peer),
        "units": _units(units, peer["units"]),
        "ms": "-" if ms is None else f"{ms:.2f}",
    }


def memory(peer: dict[str, Any]) -> str:
    """What its units and their K/V occupy, against its budget (its memory, capped by its
    --memory-budget)."""
    used, budget = peer.get("memory_used"), peer["memory_total"]
    if used is None or budget is None:
        return "-"
    return f"{size(used)} / {size(budget)}"


def fitting(rows: list[Row], width: int, padding: int) -> list[Column]:
    """The columns shown in `width` cells, each `padding` cells wide on either side."""
    def need(column: Column) -> int:
        return max(cell_len(cell) for cell in [column.label, *(r[column.key] for r in rows)]) + (
            2 * padding)

    shown = list(COLUMNS)
    for column in sorted(COLUMNS, key=lambda c: -c.drop):
        if sum(map(need, shown)) <= width or column.drop == 0:
            break
        shown.remove(column)
    return shown


def _battery(peer: dict[str, Any]) -> str:
    battery = peer["battery"]
    if peer["flops"] is None:
        return "-"
    if battery is None:
        return "mains"
    return f"{battery['percent']:.0f}% {'plugged' if battery['plugged'] else 'battery'}"


def _units(assigned: list[int], loaded: list[int]) -> str:
    if not assigned:
        return "-"
    text = f"{span(assigned[0], assigned[-1])} ({len(assigned)})"
    return text if loaded == assigned else text + " loading"


def ms_per_token(stats: dict[str, Any], plan: dict[str, Any] | None) -> dict[str, float]:
    """Compute milliseconds per token of each stage's peer, from an answer's statistics
    (the done event's `stats.stages`, by stage index) and the plan it ran on."""
    stages = (plan or {}).get("stages", [])
    return {stages[cost["stage"]]["peer"]: 1000 * cost["compute_s"] / cost["steps"]
            for cost in stats.get("stages") or []
            if cost["steps"] and cost["stage"] < len(stages)}


class PeersTable(DataTable):
    """The peers table; `show` replaces its rows (keyed by peer id) and picks the columns
    that fit, again whenever the pane changes size."""

    def on_mount(self) -> None:
        self.cursor_type = "none"
        self.zebra_stripes = True
        self._shown: tuple[dict[str, Any], dict[str, float]] | None = None

    def show(self, status: dict[str, Any], ms_by_peer: dict[str, float]) -> None:
        self._shown = (status, ms_by_peer)
        rows = peer_rows(status, ms_by_peer)
        columns = fitting(rows, self.scrollable_content_region.width or 10**6, self.cell_padding)
        if [c.key for c in columns] != [str(key.value) for key in self.columns]:
            self.clear(columns=True)
            for column in columns:
                self.add_column(column.label, key=column.key)
        self.clear()
        for peer, row in zip(status["peers"], rows, strict=True):
            self.add_row(*(row[c.key] for c in columns), key=peer["id"])

    def on_resize(self) -> None:
        if self._shown is not None:
            self.show(*self._shown)
