"""Small, pure formatting helpers shared by the dashboard's widgets."""

from __future__ import annotations

from typing import Any

SIZE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def names(status: dict[str, Any] | None) -> dict[str, str]:
    """Peer id -> peer name, from a status document."""
    return {p["id"]: p["name"] for p in status["peers"]} if status else {}


def name_of(peer_id: str | None, known: dict[str, str]) -> str:
    return known.get(peer_id, peer_id) if peer_id else "none"


def with_names(text: str, known: dict[str, str]) -> str:
    """`text` with every known peer id replaced by that peer's name."""
    for peer_id, name in known.items():
        text = text.replace(peer_id, name)
    return text


def size(count: float) -> str:
    """A byte count in binary units with three significant digits: 612 KiB, 1.25 GiB."""
    unit = 0
    while abs(count) >= 1024 and unit < len(SIZE_UNITS) - 1:
        count /= 1024
        unit += 1
    return f"{count:.0f} {SIZE_UNITS[unit]}" if unit == 0 else f"{count:.3g} {SIZE_UNITS[unit]}"


def span(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}-{last}"


def rate(tokens_per_s: float | None) -> str:
    return "-" if tokens_per_s is None else f"{tokens_per_s:,.1f} tokens/s"
