"""The chat pane: type a message, and the cluster's answer streams in token by token.

Each message is sent with the conversation so far (the local API's `chat` op with
`messages`); the pane keeps the transcript and the last answer's done event, and posts
`ChatPane.Answered` when an answer completes. Control characters in an answer are shown as
the replacement character, never sent to the terminal.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.message import Message
from textual.widgets import Input, Static

from peerd.errors import PeerdError
from tui.source import DaemonSource

REPLACEMENT = "\N{REPLACEMENT CHARACTER}"
SPEAKERS = {"user": ("you> ", "bold cyan"), "assistant": ("cluster> ", "bold green"),
            "error": ("error: ", "bold red"), "note": ("", "dim")}


class ChatPane(Vertical):
    class Answered(Message):
        """An answer completed; `done` is its done event (token_ids, text, stats)."""

        def __init__(self, done: dict[str, Any]):
            super().__init__()
            self.done = done

    class Reply(Message):
        """One event of the answer streaming in (or {"ok": false, "error"}), from the
        worker to the pane: handled while the pane is mounted, dropped once it is closing."""

        bubble = False

        def __init__(self, event: dict[str, Any]):
            super().__init__()
            self.event = event

    def __init__(self, source: DaemonSource, max_tokens: int, **kwargs: Any):
        super().__init__(**kwargs)
        self.source = source
        self.max_tokens = max_tokens
        self.messages: list[dict[str, str]] = []  # the conversation sent with each question
        self.transcript: list[tuple[str, str]] = []  # (speaker, text) as shown
        self.answering = False
        self.pieces: list[str] = []  # the text of each token of the current or last answer
        self.last_done: dict[str, Any] | None = None

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="transcript-scroll"):
            yield Static(id="transcript")
        yield Input(placeholder="ask the cluster (Enter sends)", id="prompt")

    def on_input_submitted(self, submitted: Input.Submitted) -> None:
        question = submitted.value.strip()
        if not question or self.answering:
            return
        submitted.input.value = ""
        submitted.input.disabled = True
        self.messages.append({"role": "user", "content": question})
        self.transcript.append(("user", question))
        self.answering, self.pieces = True, []
        self._redraw()
        self.run_worker(self._ask(), group="chat")

    async def _ask(self) -> None:
        request = {"messages": list(self.messages), "max_tokens": self.max_tokens}
        try:
            async for event in self.source.chat(request):
                self.post_message(self.Reply(event))
        except PeerdError as exc:
            self.post_message(self.Reply({"ok": False, "error": str(exc)}))

    def on_chat_pane_reply(self, reply: Reply) -> None:
        event = reply.event
        if event.get("event") == "token":
            self.pieces.append(event.get("text", ""))
        elif event.get("event") == "done":
            self._answered(event)
            self._ready()
        elif event.get("ok") is False:
            self.messages.pop()
            self.transcript.append(("error", event.get("error", "the answer failed")))
            self._ready()
        self._redraw()

    def _ready(self) -> None:
        self.answering = False
        prompt = self.query_one("#prompt", Input)
        prompt.disabled = False
        prompt.focus()

    def _answered(self, done: dict[str, Any]) -> None:
        self.messages.append({"role": "assistant", "content": done["text"]})
        self.transcript.append(("assistant", done["text"]))
        self.transcript.append(("note", _summary(done.get("stats") or {})))
        self.last_done = done
        self.post_message(self.Answered(done))

    def _redraw(self) -> None:
        streaming = [("assistant", "".join(self.pieces))] if self.answering else []
        shown = self.transcript + streaming
        text = Text()
        for speaker, line in shown:
            prefix, style = SPEAKERS[speaker]
            text.append(prefix, style).append(shown_text(line) + "\n")
        self.query_one("#transcript", Static).update(text)
        self.query_one("#transcript-scroll", VerticalScroll).scroll_end(animate=False)


def _summary(stats: dict[str, Any]) -> str:
    first, rate = stats.get("time_to_first_token_s"), stats.get("tokens_per_second")
    exits, degraded = stats.get("exit"), stats.get("degraded_tokens")
    return (f"{stats.get('generated_tokens', '?')} tokens"
            + ("" if first is None else f", first after {first:.3f} s")
            + ("" if rate is None else f", {rate:.1f} tokens/s")
            + ("" if not exits or not exits["exited"] else f", {exits['exited']} from the exit")
            + ("" if not degraded else f", {degraded} degraded (the exit alone)"))


def shown_text(text: str) -> str:
    """`text` safe for the screen: control characters (which a model may well produce)
    become the replacement character; line breaks stay."""
    return "".join(c if c.isprintable() or c == "\n" else REPLACEMENT for c in text)
