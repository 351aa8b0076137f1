"""`peerd dashboard`: a live Textual view of the cluster, from the local daemon's socket.

The dashboard follows the daemon through `tui.source.Feed` (one event subscription; the
status document is fetched again whenever an event says something changed) and shows: the
peers table, the plan as a ring drawn to scale, tokens/s and latency sparklines, the event
log, and a chat pane that streams answers.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path
from typing import Any

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.message import Message
from textual.widgets import Footer, Static

from peerd import statedir
from peerd.commands.client import call
from tui.figures import name_of, names
from tui.source import DaemonSource, Feed
from tui.widgets.chat import ChatPane
from tui.widgets.events import EventLog
from tui.widgets.peers import PeersTable, ms_per_token
from tui.widgets.plan import Measured, PlanView
from tui.widgets.rates import CounterRates, RateCharts

CHAT_MAX_TOKENS = 64


# The feed's news reaches the widgets as messages: they are handled while the app runs and
# dropped once it is closing, when widgets may already be gone.
class NewStatus(Message):
    def __init__(self, status: dict[str, Any]):
        super().__init__()
        self.status = status


class NewEvent(Message):
    def __init__(self, event: dict[str, Any]):
        super().__init__()
        self.event = event


class Unreachable(Message):
    def __init__(self, reason: str):
        super().__init__()
        self.reason = reason


class DashboardApp(App):
    TITLE = "peerd dashboard"
    BINDINGS = [Binding("ctrl+q", "quit", "quit", priority=True)]
    AUTO_FOCUS = "#prompt"  # typing goes to the chat pane
    # Below 120 columns the event log takes half the width, below 40 rows the chat pane has
    # fewer: at 80×24 every pane keeps its lines to one row each (cut with "…" where too long).
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (120, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (40, "-tall")]
    CSS = """
    #summary { text-wrap: nowrap; text-overflow: ellipsis; }
    #summary { height: auto; padding: 0 1; background: $boost; }
    PeersTable { height: auto; max-height: 40%; }
    #main { height: 1fr; }
    #left { width: 3fr; }
    PlanView { height: auto; padding: 1 1 0 1; }
    RateCharts { height: auto; padding: 1 1 0 1; }
    RateCharts Sparkline { height: 2; margin-bottom: 1; }
    EventLog { width: 2fr; height: 1fr; border: round $primary; }
    ChatPane { height: 11; border: round $secondary; }
    .-narrow #left, .-narrow EventLog { width: 1fr; }
    .-short ChatPane { height: 8; }
    #transcript-scroll { height: 1fr; }
    """

    def __init__(self, state_dir: Path, chat_max_tokens: int = CHAT_MAX_TOKENS):
        super().__init__()
        self.source = DaemonSource(state_dir)
        self.feed = Feed(
            self.source,
            lambda status: self.post_message(NewStatus(status)),
            lambda event: self.post_message(NewEvent(event)),
            lambda reason: self.post_message(Unreachable(reason)),
        )
        self.chat_max_tokens = chat_max_tokens
        self.status: dict[str, Any] | None = None
        self.trouble: str | None = None
        self.plan_event: dict[str, Any] | None = None  # the latest `plan` event seen
        self.rates = CounterRates()
        self.stage_ms: dict[str, float] = {}  # compute ms per token by peer, last answer
        self.last_answer_tps: float | None = None

    def compose(self) -> ComposeResult:
        yield Summary("connecting to the daemon…", id="summary")
        yield PeersTable()
        with Horizontal(id="main"):
            with Vertical(id="left"):
                yield PlanView()
                yield RateCharts()
            yield EventLog()
        yield ChatPane(self.source, self.chat_max_tokens)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(EventLog).border_title = "events"
        self.query_one(ChatPane).border_title = "chat"
        self.run_worker(self.feed.run(), group="feed")

    # -- the feed ------------------------------------------------------------------------------

    def on_new_status(self, message: NewStatus) -> None:
        if names(message.status) != names(self.status):
            with contextlib.suppress(NoMatches):  # see _redraw
                self.query_one(EventLog).rename(names(message.status))
        self.status, self.trouble = message.status, None
        self.rates.add(message.status.get("dataplane"), time.monotonic())
        self._redraw()

    def on_new_event(self, message: NewEvent) -> None:
        if message.event.get("event") == "plan":
            self.plan_event = message.event
        with contextlib.suppress(NoMatches):  # see _redraw
            self.query_one(EventLog).add(message.event, names(self.status))

    def on_unreachable(self, message: Unreachable) -> None:
        self.trouble = message.reason
        self._redraw()

    def on_chat_pane_answered(self, answered: ChatPane.Answered) -> None:
        stats = answered.done.get("stats") or {}
        self.last_answer_tps = stats.get("tokens_per_second")
        self.stage_ms = ms_per_token(stats, (self.status or {}).get("plan"))
        self.feed.changed()

    # -- drawing -------------------------------------------------------------------------------

    def _redraw(self) -> None:
        # a status can come before the screen is composed, or after it closed
        with contextlib.suppress(NoMatches):
            self._draw()

    def _draw(self) -> None:
        self._show_summary()
        status, known = self.status, names(self.status)
        if status is None:
            return
        self.query_one(PeersTable).show(status, self.stage_ms)
        self.query_one(PlanView).show(status, known, self.plan_event,
                                      Measured(self.rates.now, self.last_answer_tps))
        self.query_one(RateCharts).show(self.rates)

    def _show_summary(self) -> None:
        self.query_one(Summary).show(self.status, self.trouble)


def summary_line(status: dict[str, Any], width: int | None = None) -> Text:
    """The header: this peer and its role, then (as `width` cells allow, least needed left
    out first) the peers alive, the leader, the model and the cluster."""
    known, model = names(status), status.get("model")
    alive = sum(1 for p in status["peers"] if p["state"] == "alive")
    head = Text().append(status["name"], "bold").append(f" ({status['role']})")
    parts = [  # (what, the order it is left out in: highest first)
        (f"{alive} of {len(status['peers'])} peers alive", 0),
        (f"leader {name_of(status['leader'], known)}, epoch {status['epoch']}", 1),
        (_model_part(model, known), 2) if model else None,
        (f"cluster {status['cluster']}", 3),
    ]
    kept = [part for part in parts if part is not None]
    for dropped in sorted(kept, key=lambda part: -part[1]):
        if width is None or _joined(head, kept).cell_len <= width:
            break
        kept.remove(dropped)
    line = _joined(head, kept)
    line.no_wrap, line.overflow = True, "ellipsis"
    return line


def _model_part(model: dict[str, Any], known: dict[str, str]) -> str:
    text = f"model {model['name']} on {name_of(model['peer'], known)}: {model['state']}"
    return text + (f", quant {model['quant']}" if model.get("quant") else "")


def _joined(head: Text, parts: list[tuple[str, int]]) -> Text:
    return head.copy().append("".join(f" · {what}" for what, _ in parts))


class Summary(Static):
    """The header line: the status's summary at the width it has, or the trouble."""

    _shown: tuple[dict[str, Any] | None, str | None] | None = None

    def show(self, status: dict[str, Any] | None, trouble: str | None) -> None:
        self._shown = (status, trouble)
        width = self.content_size.width or None
        if trouble is not None:
            self.update(Text(f"{trouble} (connecting again)", "bold red"))
        elif status is not None:
            self.update(summary_line(status, width))

    def on_resize(self) -> None:
        if self._shown is not None:
            self.show(*self._shown)


def cmd_dashboard(args: argparse.Namespace) -> int:
    state_dir = statedir.resolve(args.state_dir)
    call(state_dir, {"op": "status"})  # a one-line error before the screen is taken over
    app = DashboardApp(state_dir)
    app.run()
    return app.return_code or 0
