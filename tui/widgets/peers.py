"""The peers table: one row per peer of the status document, with its measured figures,
the units the plan assigns it and what its stage cost per token in the last answer."""

from __future__ import annotations

from typing import Any

from textual.widgets import DataTable

from tui.figures import size, span

COLUMNS = ("name", "address", "role", "state", "GFLOP/s", "memory used/avail", "load",
           "battery", "units", "ms/token")


def peer_rows(status: dict[str, Any], stage_ms: dict[str, float]) -> list[tuple[str, ...]]:
    """The table's cells, one tuple per peer; `stage_ms` is compute ms per token by peer id."""
    plan = status.get("plan") or {}
    assigned = {s["peer"]: s["units"] for s in plan.get("stages", [])}
    return [_row(peer, status["leader"], assigned.get(peer["id"], []), stage_ms.get(peer["id"]))
            for peer in status["peers"]]


def _row(peer: dict[str, Any], leader: str | None, units: list[int],
         ms: float | None) -> tuple[str, ...]:
    return (
        peer["name"] + (" *" if peer["self"] else ""),
        peer["address"],
        "leader" if peer["id"] == leader else "follower",
        peer["state"] + (" DUPLICATE" if peer["duplicate"] else ""),
        "-" if peer["flops"] is None else f"{peer['flops'] / 1e9:.1f}",
        _memory(peer),
        "-" if peer["load"] is None else f"{peer['load']:.0%}",
        _battery(peer),
        _units(units, peer["units"]),
        "-" if ms is None else f"{ms:.2f}",
    )


def _memory(peer: dict[str, Any]) -> str:
    total, available = peer["memory_total"], peer["memory_available"]
    if total is None or available is None:
        return "-"
    return f"{size(total - available)} / {size(available)}"


def _battery(peer: dict[str, Any]) -> str:
    battery = peer["battery"]
    if peer["flops"] is None:
        return "-"
    if battery is None:
        return "mains"
    return f"{battery['percent']:.0f}% {'plugged' if battery['plugged'] else 'on battery'}"


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
    """The peers table; `show` replaces its rows (keyed by peer id)."""

    def on_mount(self) -> None:
        self.cursor_type = "none"
        self.zebra_stripes = True
        self.add_columns(*COLUMNS)

    def show(self, status: dict[str, Any], ms_by_peer: dict[str, float]) -> None:
        self.clear()
        for peer, cells in zip(status["peers"], peer_rows(status, ms_by_peer),
                               strict=True):
            self.add_row(*cells, key=peer["id"])
