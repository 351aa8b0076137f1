"""The local API: newline-delimited JSON over a Unix socket (mode 0600) in the state dir.

Each request is one JSON object on one line, ``{"op": NAME, ...}``; the daemon answers with
one or more JSON lines. Every answer that is not an event has ``"ok"``: true with the
result, or false with ``"error"``. A malformed or over-long request (more than
``MAX_LINE_BYTES``) gets an error answer and the connection stays usable. ``subscribe``
answers ``{"ok": true}`` and then streams ``{"event": ...}`` lines until the client leaves:
first the recent events the daemon kept (`EventBus`), then the new ones as they come.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from peerd.errors import PeerdError, invalid

log = logging.getLogger("peerd.api.local_api")

MAX_LINE_BYTES = 64 * 1024
# Connections waiting to be accepted; past asyncio's default of 100, a burst of clients
# connecting at once (scripts polling status, dashboards) would see theirs refused.
LISTEN_BACKLOG = 1024
EVENT_QUEUE = 1000
EVENT_HISTORY = 200  # recent events a new subscriber receives first
MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes including the terminating NUL

Send = Callable[[dict[str, Any]], Awaitable[None]]
Op = Callable[[dict[str, Any], Send], Awaitable[None]]


class EventBus:
    """Fan-out of daemon events to subscribers, with the most recent `history` events kept
    for subscribers yet to come. Each event is stamped with the time it was published
    (`at`, Unix seconds). A slow subscriber loses its oldest events rather than slowing the
    daemon."""

    def __init__(self, history: int = EVENT_HISTORY) -> None:
        self._queues: set[asyncio.Queue] = set()
        self._history: deque[dict[str, Any]] = deque(maxlen=history)

    def publish(self, event: dict[str, Any]) -> None:
        stamped = {**event, "at": time.time()}
        self._history.append(stamped)
        for queue in self._queues:
            if queue.full():
                queue.get_nowait()
            queue.put_nowait(stamped)

    @property
    def subscribers(self) -> int:
        return len(self._queues)

    @contextlib.contextmanager
    def subscription(self):
        """(past, queue): the kept events, oldest first, and a queue of every event published
        from now on. Both are taken with no await between them, so on the one event loop no
        event falls between the two or is in both."""
        queue: asyncio.Queue = asyncio.Queue(EVENT_QUEUE)
        past = list(self._history)
        self._queues.add(queue)
        try:
            yield past, queue
        finally:
            self._queues.discard(queue)


class LocalApi:
    def __init__(self, path: Path, ops: dict[str, Op]):
        if len(os.fsencode(path)) > MAX_SOCKET_PATH:
            raise PeerdError(f"socket path {path} is too long; use a shorter --state-dir")
        self.path = path
        self._ops = ops
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task] = set()

    async def start(self) -> None:
        self.path.unlink(missing_ok=True)
        old_umask = os.umask(0o177)  # the socket is created 0600, never briefly wider
        try:
            self._server = await asyncio.start_unix_server(
                self._serve, path=str(self.path), limit=MAX_LINE_BYTES, backlog=LISTEN_BACKLOG
            )
        finally:
            os.umask(old_umask)
        os.chmod(self.path, 0o600)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        self.path.unlink(missing_ok=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None  # start_server runs each connection in a task of its own
        self._connections.add(task)

        async def send(answer: dict[str, Any]) -> None:
            # A write that found the client gone closed the transport; uvloop then raises
            # RuntimeError on the next write, where the op must see the client leaving.
            if writer.is_closing():
                raise ConnectionResetError("the client went away")
            writer.write(json.dumps(answer, separators=(",", ":")).encode() + b"\n")
            await writer.drain()

        try:
            while (line := await _read_line(reader)) != b"":
                await self._answer(line, send)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            # `close` ends the connection. Ending quietly rather than cancelled: Python 3.11
            # logs a cancelled connection task as an unhandled error with a traceback.
            pass
        finally:
            self._connections.discard(task)
            writer.close()

    async def _answer(self, line: bytes | None, send: Send) -> None:
        if line is None:
            await send(invalid(f"request longer than {MAX_LINE_BYTES} bytes").answer())
            return
        try:
            request = json.loads(line)
        except ValueError:
            await send(invalid("request is not JSON").answer())
            return
        except RecursionError:  # e.g. 30000 nested brackets, well within one line
            await send(invalid("request is nested too deeply").answer())
            return
        if not isinstance(request, dict) or not isinstance(request.get("op"), str):
            await send(invalid('request must be an object with a string "op"').answer())
            return
        op = self._ops.get(request["op"])
        if op is None:
            await send(invalid(f"unknown op {request['op']!r}").answer())
            return
        try:
            await op(request, send)
        except PeerdError as exc:
            await send(exc.answer())
        except (ConnectionError, asyncio.CancelledError):
            raise
        except Exception:  # a bug in one op must not take the socket down
            log.exception("op %r failed", request["op"])
            await send({"ok": False, "error": f"internal error in {request['op']!r}"})


async def _read_line(reader: asyncio.StreamReader) -> bytes | None:
    """The next request line; None for an over-long line (skipped); b"" at end of stream."""
    try:
        line = await reader.readuntil(b"\n")
    except asyncio.IncompleteReadError as exc:
        return exc.partial
    except asyncio.LimitOverrunError:
        await _skip_line(reader)
        return None
    return line


async def _skip_line(reader: asyncio.StreamReader) -> None:
    while True:
        try:
            await reader.readuntil(b"\n")
            return
        except asyncio.LimitOverrunError as exc:
            await reader.readexactly(exc.consumed)
