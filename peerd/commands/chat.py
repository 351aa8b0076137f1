"""`peerd chat`: talk to the cluster through the local daemon's socket.

The request is one line, ``{"op": "chat", "messages": [...] | "prompt_ids": [...],
"max_tokens", "temperature", "top_k", "top_p", "seed"}``; the daemon answers with a stream of
``{"event": "token", "token": ID, "text": PIECE}`` lines and ends with ``{"event": "done",
"ok": true, "token_ids", "text", "stats"}`` or ``{"ok": false, "error": REASON}``. Closing the
connection cancels the answer on every peer, which is what Ctrl-C does.

With `--prompt` or `--prompt-ids` it answers once and exits; with neither it is an interactive,
multi-turn `Session`. Answers go to stdout; the prompt marker, notices and errors go to
stderr, so `peerd chat < questions > answers` keeps only the answers. At a terminal the
prompt has readline's line editing and a history kept in `<state-dir>/chat_history`.

Without `--max-tokens` the request names no limit and the head lets the answer run to the
end-of-sequence token or the context limit; an answer that ended at a limit says so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peerd import statedir
from peerd.commands.client import call, chat_events
from peerd.errors import ErrorKind, PeerdError

# An answer may take a while to start when the cluster is busy; the daemon's own deadlines
# end a stuck answer with an error, so the client waits without a timeout of its own.
ANSWER_TIMEOUT_S = None

PROMPT = "you> "
STOPPED = "[answer stopped]"
HISTORY_NAME = "chat_history"  # in the state directory
HISTORY_LENGTH = 1000  # lines kept
SIGNAL_CHECK_S = 0.1  # how often the prompt notices a Ctrl-C its wait missed
BANNER = "peerd chat: type a message; /help lists commands; Ctrl-C stops an answer, Ctrl-D leaves."
HELP = """\
/reset  forget the conversation so far
/help   this list
/exit   leave (so do Ctrl-D, and Ctrl-C at the prompt)"""

Message = dict[str, str]


def cmd_chat(args: argparse.Namespace) -> int:
    state_dir = statedir.resolve(args.state_dir)
    settings = _settings(args)
    if args.prompt_ids is not None:
        return _answer_once(state_dir, {"prompt_ids": args.prompt_ids, **settings}, args.json)
    if args.prompt is not None:
        messages = [{"role": "user", "content": args.prompt}]
        return _answer_once(state_dir, {"messages": messages, **settings}, args.json)
    if args.json:
        raise PeerdError("--json needs --prompt or --prompt-ids")
    call(state_dir, {"op": "status"})  # no daemon: say so now, not after the first message
    return Session(state_dir, settings, _lines(state_dir / HISTORY_NAME)).run()


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The request's sampling settings; no "max_tokens" without --max-tokens."""
    settings = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
                "seed": args.seed}
    if args.max_tokens is None:
        return settings
    if args.max_tokens < 1:
        raise PeerdError(f"--max-tokens must be at least 1, not {args.max_tokens}")
    return {"max_tokens": args.max_tokens, **settings}


class NoTokenizer(PeerdError):
    """The model has no tokenizer: it takes prompts as token ids only."""


def _answer_once(state_dir: Path, request: dict[str, Any], as_json: bool) -> int:
    if as_json:
        done = stream_answer(state_dir, request)
        print(json.dumps({k: done.get(k) for k in ("token_ids", "text", "finish_reason",
                                                     "degraded", "stats")}))
    else:
        _answer_line(state_dir, request)
    return 0


def stream_answer(
    state_dir: Path, request: dict[str, Any], on_piece: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Send one chat request; call `on_piece(text)` per token; return the final event.
    An exception (Ctrl-C) closes the connection at once, which ends the answer."""
    event: dict[str, Any] = {}  # chat_events yields at least one event, or raises
    with contextlib.closing(chat_events(state_dir, request, ANSWER_TIMEOUT_S)) as events:
        for event in events:
            if event.get("ok") is False:
                _refuse(event)
            if event.get("event") == "token" and on_piece is not None:
                on_piece(event.get("text", ""))
    return event  # the done event: the last, since an error answer was refused above


def _refuse(answer: dict[str, Any]) -> None:
    kind = ErrorKind.parse(answer.get("kind"))
    if kind is ErrorKind.NO_TOKENIZER:
        raise NoTokenizer("the model has no tokenizer, so it takes no text: "
                          "give the prompt as token ids with --prompt-ids", kind)
    raise PeerdError(answer.get("error", "the cluster could not answer"), kind)


def _answer_line(state_dir: Path, request: dict[str, Any]) -> dict[str, Any]:
    """Stream an answer to stdout as it comes; the line is ended even if the answer is not.
    An answer cut short by a limit is followed by a notice saying which."""
    try:
        done = stream_answer(state_dir, request, _print_piece)
    finally:
        _print_piece("\n")
    if done.get("finish_reason") == "length":
        _say(cut_notice(request.get("max_tokens"), done))
    if done.get("degraded"):
        _say(f"[degraded: {done['stats']['degraded_tokens']} tokens came from the first "
             "peer's early exit alone, while the peers behind it were unreachable]")
    return done


def cut_notice(max_tokens: int | None, done: dict[str, Any]) -> str:
    """What an answer that stopped at a limit rather than at its end says."""
    if max_tokens is not None:
        return f"[stopped at --max-tokens {max_tokens}]"
    context = done["stats"]["prompt_tokens"] + len(done["token_ids"])
    return f"[stopped at the context limit of {context} tokens]"


def _print_piece(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _say(text: str, end: str = "\n") -> None:
    sys.stdout.flush()  # keep stderr's notices after the answer text already shown
    sys.stderr.write(text + end)
    sys.stderr.flush()


@dataclass
class Session:
    """An interactive chat: every answer is asked with the whole conversation so far."""

    state_dir: Path
    settings: dict[str, Any]
    read_line: Callable[[], str | None]
    messages: list[Message] = field(default_factory=list)

    def run(self) -> int:
        _say(BANNER)
        while (line := self.read_line()) is not None:
            try:
                if not self._take(line.strip()):
                    break
            except KeyboardInterrupt:
                _say(STOPPED)
        return 0

    def _take(self, line: str) -> bool:
        """Act on one line; False when the session should end."""
        if line == "/exit":
            return False
        if line == "/reset":
            self.messages = []
            _say("[conversation cleared]")
        elif line == "/help":
            _say(HELP)
        elif line.startswith("/"):
            _say(f"unknown command {line.split()[0]}; /help lists the commands")
        elif line:
            self._turn(line)
        return True

    def _turn(self, text: str) -> None:
        """Ask with `text` as the next user message; keep the turn only if it was answered.

        A stopped or failed answer leaves the conversation as it was, as if never asked.
        """
        asked = [*self.messages, {"role": "user", "content": text}]
        try:
            done = _answer_line(self.state_dir, {"messages": asked, **self.settings})
        except NoTokenizer:
            raise  # every message would fail the same way
        except PeerdError as exc:
            _say(f"peerd: {exc}")
            return
        self.messages = [*asked, {"role": "assistant", "content": done["text"]}]


def _lines(history: Path) -> Callable[[], str | None]:
    """How the session reads its lines: edited at a terminal, else as they come on stdin."""
    if sys.stdin.isatty() and sys.stderr.isatty():
        return EditedLines(history).read
    return _read_line


def _read_line() -> str | None:
    """The next line typed after the prompt; None at end of input or on Ctrl-C."""
    try:
        _say(PROMPT, end="")
        line = sys.stdin.readline()
    except KeyboardInterrupt:
        line = ""
    if not line:
        _say("")  # the shell's prompt then starts on a line of its own
        return None
    return line


class EditedLines:
    """Lines typed at a terminal with readline's editing (arrow keys, Ctrl-R, ...) and a
    history that outlives the session: each line is appended to the history file as it is
    entered, so the history is saved however the session ends; the file keeps the last
    HISTORY_LENGTH lines."""

    def __init__(self, history: Path) -> None:
        import readline  # only at a terminal: it may write terminal codes when imported

        self.readline = readline
        self.history: Path | None = history
        readline.set_auto_history(False)  # added by hand: no blank or repeated lines
        readline.set_history_length(HISTORY_LENGTH)
        try:
            history.touch(mode=0o600)  # what was asked is the user's own business
            readline.read_history_file(history)
        except OSError as exc:
            self.history = None
            _say(f"[no chat history: cannot use {history}: {exc.strerror}]")

    def read(self) -> str | None:
        """The next line; None at end of input (Ctrl-D) or on Ctrl-C."""
        try:
            line = _prompted_input()
        except (EOFError, KeyboardInterrupt):
            _say("")
            return None
        self._remember(line)
        return line

    def _remember(self, line: str) -> None:
        readline = self.readline
        length = readline.get_current_history_length()
        if not line.strip() or (length and readline.get_history_item(length) == line):
            return
        readline.add_history(line)
        if self.history is not None:
            with contextlib.suppress(OSError):  # a full disk loses history, not the chat
                readline.append_history_file(1, self.history)


def _prompted_input() -> str:
    """input() with the prompt and the line being edited on stderr. input() edits with
    readline only when file descriptor 1 is a terminal, and draws there: 1 points at stderr
    while it reads, so answers piped from stdout never hold the prompt."""
    sys.stdout.flush()
    stdout = os.dup(1)
    try:
        os.dup2(2, 1)
        with _signals_checked_while_waiting():
            return input(PROMPT)
    finally:
        os.dup2(stdout, 1)
        os.close(stdout)


@contextlib.contextmanager
def _signals_checked_while_waiting() -> Iterator[None]:
    """A timer that interrupts input()'s wait for a key ten times a second.

    CPython's readline loop checks for signals only when its select() is interrupted, so a
    Ctrl-C that lands after the prompt is drawn but before select() starts is noticed at the
    next key, not at once: 2 of 100 sessions typed ^C the moment the prompt showed hung
    there, none of 300 with the timer, whose next tick runs the pending KeyboardInterrupt.
    """
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: None)
    signal.setitimer(signal.ITIMER_REAL, SIGNAL_CHECK_S, SIGNAL_CHECK_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
