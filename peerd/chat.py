"""`peerd chat`: talk to the cluster through the local daemon's socket.

The request is one line, ``{"op": "chat", "messages": [...] | "prompt_ids": [...],
"max_tokens", "temperature", "top_k", "top_p", "seed"}``; the daemon answers with a stream of
``{"event": "token", "token": ID, "text": PIECE}`` lines and ends with ``{"event": "done",
"ok": true, "token_ids", "text", "stats"}`` or ``{"ok": false, "error": REASON}``. Closing the
connection cancels the answer on every peer, which is what Ctrl-C does.

With `--prompt` or `--prompt-ids` it answers once and exits; with neither it is an interactive,
multi-turn session.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from peerd import statedir
from peerd.client import Connection
from peerd.errors import PeerdError

# An answer may take a while to start when the cluster is busy; the daemon's own deadlines
# end a stuck answer with an error, so the client waits without a timeout of its own.
ANSWER_TIMEOUT_S = None


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
    return _interactive(state_dir, settings)


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    if args.max_tokens < 1:
        raise PeerdError(f"--max-tokens must be at least 1, not {args.max_tokens}")
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": args.seed,
    }


def _answer_once(state_dir, request: dict[str, Any], as_json: bool) -> int:
    show = None if as_json else _print_piece
    done = stream_answer(state_dir, request, show)
    if as_json:
        print(json.dumps({k: done[k] for k in ("token_ids", "text", "stats")}))
    else:
        print()
    return 0


def stream_answer(state_dir, request: dict[str, Any], on_piece=None) -> dict[str, Any]:
    """Send one chat request; call `on_piece(text)` per token; return the final event."""
    with Connection(state_dir, timeout=ANSWER_TIMEOUT_S) as connection:
        connection.send({"op": "chat", **request})
        while (event := connection.read()) is not None:
            if event.get("ok") is False:
                raise PeerdError(event.get("error", "the cluster could not answer"))
            if event.get("event") == "token" and on_piece is not None:
                on_piece(event.get("text", ""))
            elif event.get("event") == "done":
                return event
    raise PeerdError("the daemon closed the connection before the answer was complete")


def _print_piece(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _interactive(state_dir, settings: dict[str, Any]) -> int:
    print("peerd chat: type a message; Ctrl-C stops an answer, Ctrl-D leaves.", file=sys.stderr)
    messages: list[dict[str, str]] = []
    while True:
        try:
            line = input("you> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        try:
            done = stream_answer(state_dir, {"messages": messages, **settings}, _print_piece)
        except KeyboardInterrupt:
            messages.pop()
            print("\n[answer cancelled]", file=sys.stderr)
            continue
        except PeerdError as exc:
            messages.pop()
            print(f"\npeerd: {exc}", file=sys.stderr)
            continue
        print()
        messages.append({"role": "assistant", "content": done["text"]})
