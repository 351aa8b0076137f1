"""The event log: every daemon event as one readable line, newest last.

Known events get their own sentence (joins and departures, elections, measurement rounds,
plans with their reason, rebalances with their predicted gain); any other event is shown
generically as its name and fields, so a new kind of event appears without a change here.
Peer ids are shown as peer names, each line with the time the daemon published its event
(the daemon sends the events it kept from before the dashboard opened first). An event whose
line equals the one before it, of the same kind (the periodic measurement rounds of an
unchanged cluster), is not shown again: that line counts it ("… ×3") and takes its time. The
log keeps what it showed (`entries`) so that tests and other widgets can ask for it.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from rich.text import Text
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip

from tui.figures import name_of, rate, span, with_names

MAX_VALUE_CHARS = 60
MAX_ENTRIES = 5000  # the oldest go first

Event = dict[str, Any]


@dataclass(frozen=True)
class Entry:
    at: float  # when the daemon published it (its latest, for a repeated line)
    event: Event  # the latest, for a repeated line
    line: str
    count: int = 1  # times this line came in a row

    @property
    def kind(self) -> str:
        return self.event.get("event", "")

    @property
    def shown(self) -> str:
        repeats = f" ×{self.count}" if self.count > 1 else ""
        return f"{_clock(self.at)} {self.line}{repeats}"


def describe(event: Event, known: dict[str, str]) -> str:
    """One line for `event`, with peer ids replaced by names."""
    special = _DESCRIBE.get(event.get("event", ""))
    try:
        line = special(event, known) if special else None
    except (KeyError, TypeError, ValueError):
        line = None  # a known event with unexpected fields: show it generically
    return with_names(line or _generic(event), known)


def _peer(event: Event, known: dict[str, str]) -> str:
    name = event.get("name") or name_of(event["id"], known)
    return f"{name} is {event['state']}"


def _leader(event: Event, known: dict[str, str]) -> str:
    if event["leader"] is None:
        return f"election: epoch {event['epoch']} has no leader yet"
    return f"election: {name_of(event['leader'], known)} leads epoch {event['epoch']}"


def _measurements(event: Event, known: dict[str, str]) -> str:
    return (f"measured {event['peers']} peers and {event['links']} links "
            f"(epoch {event['epoch']})")


def _plan(event: Event, known: dict[str, str]) -> str:
    head = f"plan {event['plan_id']} (epoch {event['epoch']})"
    if not event["stages"]:
        return f"{head}: no stages: {event['problem']} [{event['reason']}]"
    stages = ", ".join(f"{name_of(s['peer'], known)} {span(s['first'], s['last'])}"
                       for s in event["stages"])
    predicted = (event.get("predicted") or {}).get("throughput_tps")
    return f"{head}: {stages}; predicted {rate(predicted)} [{event['reason']}]"


def _rebalance(event: Event, known: dict[str, str]) -> str:
    head = f"rebalance to plan {event['plan_id']}: {event['reason']}"
    gain = event["gain"]
    return head if gain is None else f"{head}; predicted gain {gain:+.0%}"


def _duplicate(event: Event, known: dict[str, str]) -> str:
    return f"another daemon uses the identity of {name_of(event['id'], known)}: {event['detail']}"


_DESCRIBE: dict[str, Callable[[Event, dict[str, str]], str]] = {
    "peer": _peer,
    "leader": _leader,
    "measurements": _measurements,
    "plan": _plan,
    "rebalance": _rebalance,
    "duplicate": _duplicate,
}


def _generic(event: Event) -> str:
    fields = ", ".join(f"{key}={_short(value)}" for key, value in event.items()
                       if key not in ("event", "at"))
    return f"{event.get('event', '?')}: {fields}" if fields else str(event.get("event", "?"))


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    return text if len(text) <= MAX_VALUE_CHARS else text[: MAX_VALUE_CHARS - 1] + "…"


class EventLog(ScrollView):
    """The log widget; `add` shows an event, `entries` and `of_kind` tell what it showed.

    Each entry is one row, cut to the pane's width with an ellipsis (never wrapped), and
    drawn at the width the pane has now, so a resized pane redraws every row to fit."""

    DEFAULT_CSS = "EventLog { overflow-x: hidden; }"

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.entries: deque[Entry] = deque(maxlen=MAX_ENTRIES)

    def add(self, event: Event, known: dict[str, str]) -> None:
        at = event.get("at")
        entry = Entry(at if isinstance(at, int | float) else time.time(), event,
                      describe(event, known))
        last = self.entries[-1] if self.entries else None
        if last is not None and (last.kind, last.line) == (entry.kind, entry.line):
            self.entries[-1] = replace(entry, count=last.count + 1)
        else:
            self.entries.append(entry)
        following = self.is_vertical_scroll_end
        self.virtual_size = Size(self.scrollable_content_region.width, len(self.entries))
        if following:
            self.scroll_end(animate=False, immediate=True, x_axis=False)
        self.refresh()

    def rename(self, known: dict[str, str]) -> None:
        """Describe the entries again with these peer names (the daemon's kept events can
        come before the first status document names the peers)."""
        self.entries = deque((replace(e, line=describe(e.event, known)) for e in self.entries),
                             maxlen=MAX_ENTRIES)
        self.refresh()

    def of_kind(self, kind: str) -> list[Entry]:
        return [e for e in self.entries if e.kind == kind]

    def on_resize(self) -> None:
        self.virtual_size = Size(self.scrollable_content_region.width, len(self.entries))

    def render_line(self, y: int) -> Strip:
        _, scroll_y = self.scroll_offset
        width, index = self.scrollable_content_region.width, scroll_y + y
        style = self.rich_style
        if index >= len(self.entries):
            return Strip.blank(width, style)
        text = Text(self.entries[index].shown, style=style, no_wrap=True, overflow="ellipsis")
        text.truncate(width, overflow="ellipsis", pad=True)
        return Strip(text.render(self.app.console), width).apply_offsets(0, index)


def _clock(at: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at))
