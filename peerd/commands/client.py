"""`peerd status` and `peerd stop`, and the connection every client of the local socket uses."""

from __future__ import annotations

import argparse
import json
import socket
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

from peerd import statedir
from peerd.api import status
from peerd.errors import PeerdError

TIMEOUT_S = 10.0
STOP_WAIT_S = 15.0


class Connection:
    """One connection to the local API: send requests, read answers line by line."""

    def __init__(self, state_dir: Path, timeout: float | None = TIMEOUT_S):
        path = statedir.socket_path(state_dir)
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._socket.settimeout(timeout)
        try:
            self._socket.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            self._socket.close()
            raise PeerdError(
                f"no daemon is running for {state_dir} (start one: peerd start)"
            ) from None
        except OSError as exc:
            self._socket.close()
            raise PeerdError(f"cannot reach the daemon at {path}: {exc.strerror}") from None
        self._lines = self._socket.makefile("rb")

    def send(self, request: dict[str, Any]) -> None:
        self._socket.sendall(json.dumps(request).encode() + b"\n")

    def read(self) -> dict[str, Any] | None:
        """The next answer, or None when the daemon closed the connection."""
        try:
            line = self._lines.readline()
        except TimeoutError:
            raise PeerdError("the daemon did not answer in time") from None
        return json.loads(line) if line else None

    def close(self) -> None:
        self._lines.close()
        self._socket.close()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def call(state_dir: Path, request: dict[str, Any]) -> dict[str, Any]:
    """One request, one answer; an error answer becomes a PeerdError."""
    with Connection(state_dir) as connection:
        connection.send(request)
        answer = connection.read()
    if answer is None:
        raise PeerdError("the daemon closed the connection without answering")
    if not answer.get("ok"):
        raise PeerdError(answer.get("error", "the daemon refused the request"))
    return answer


def chat_events(state_dir: Path, request: dict[str, Any],
                timeout: float | None = None) -> Generator[dict[str, Any], None, None]:
    """The events of one chat: each token event, then the done event or the error answer,
    which comes last; PeerdError when the daemon closes the connection before either. Close
    the iterator to cancel the answer (on every peer)."""
    with Connection(state_dir, timeout=timeout) as connection:
        connection.send({"op": "chat", **request})
        while (event := connection.read()) is not None:
            yield event
            if event.get("event") == "done" or event.get("ok") is False:
                return
    raise PeerdError("the daemon closed the connection before the answer was complete")


def events(state_dir: Path) -> Generator[dict[str, Any], None, None]:
    """Daemon events (membership, election, measurements) as they happen."""
    with Connection(state_dir, timeout=None) as connection:
        connection.send({"op": "subscribe"})
        answer = connection.read()
        if not answer or not answer.get("ok"):
            raise PeerdError("the daemon refused the subscription")
        while (event := connection.read()) is not None:
            yield event


def cmd_status(args: argparse.Namespace) -> int:
    document = call(statedir.resolve(args.state_dir), {"op": "status"})["status"]
    print(json.dumps(document, indent=1) if args.json else status.render(document))
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    state_dir = statedir.resolve(args.state_dir)
    call(state_dir, {"op": "stop"})
    deadline = time.monotonic() + STOP_WAIT_S
    while statedir.socket_path(state_dir).exists():
        if time.monotonic() > deadline:
            raise PeerdError(f"the daemon did not stop within {STOP_WAIT_S:.0f}s")
        time.sleep(0.05)
    print("peerd stopped")
    return 0
