"""The event log: every daemon event as one readable line, newest last.

Known events get their own sentence (joins and departures, elections, measurement rounds,
plans with their reason, rebalances with their predicted gain); any other event is shown
generically as its name and fields, so a new kind of event appears without a change here.
Peer ids are shown as peer names. A line equal to the one before it (the periodic measurement
rounds of an unchanged cluster) is not repeated: the log's subtitle counts it instead. The log
keeps what it showed (`entries`) so that tests and other widgets can ask for it.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from textual.widgets import RichLog

from tui.figures import name_of, rate, span, with_names

MAX_VALUE_CHARS = 60
MAX_ENTRIES = 5000  # the oldest go first
MIN_WIDTH = 20  # lines wrap at the log's width, down to this

Event = dict[str, Any]


@dataclass(frozen=True)
class Entry:
    at: float  # time.time() when it arrived
    event: Event
    line: str


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
    fields = ", ".join(f"{key}={_short(value)}" for key, value in event.items() if key != "event")
    return f"{event.get('event', '?')}: {fields}" if fields else str(event.get("event", "?"))


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    return text if len(text) <= MAX_VALUE_CHARS else text[: MAX_VALUE_CHARS - 1] + "…"


class EventLog(RichLog):
    """The log widget; `add` shows an event, `entries` and `of_kind` tell what it showed."""

    def __init__(self, **kwargs: Any):
        super().__init__(wrap=True, min_width=MIN_WIDTH, markup=False, max_lines=MAX_ENTRIES,
                         **kwargs)
        self.entries: deque[Entry] = deque(maxlen=MAX_ENTRIES)
        self.repeats = 0  # times the last line came again

    def add(self, event: Event, known: dict[str, str]) -> None:
        entry = Entry(time.time(), event, describe(event, known))
        if self.entries and self.entries[-1].line == entry.line:
            self.repeats += 1
            self.border_subtitle = f"last line again ×{self.repeats}, {_clock(entry.at)}"
            return
        self.repeats, self.border_subtitle = 0, ""
        self.entries.append(entry)
        self.write(f"{_clock(entry.at)} {entry.line}")

    def of_kind(self, kind: str) -> list[Entry]:
        return [e for e in self.entries if e.event.get("event") == kind]


def _clock(at: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at))
